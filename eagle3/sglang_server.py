"""SGLang as a child process: launched from a Python that has it, healthy before it is used, and stopped with
every process it started (its scheduler and detokenizer are children in its process group).

Used by `eagle3 eval --engine sglang` (a stock server per drafter and speculative setting), the GPU demo (the
capture plugin's launcher) and the SGLang benchmarks. A server that dies or never becomes healthy raises with the
end of its log, so the reason (an unknown flag, out of memory, a bad draft model folder) is on the screen.
"""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import httpx

from shared.errors import Eagle3Error

# Compiling kernels and capturing CUDA graphs (target, draft and verify graphs with EAGLE-3) at first start.
START_TIMEOUT_S = 900.0
LOG_TAIL_LINES = 25


class SGLangServerError(Eagle3Error):
    """An SGLang server this process launched exited or did not become healthy."""


def stock_argv(model_dir: Path | str, *, port: int, extra_args: list[str] | None = None) -> list[str]:
    """`python -m sglang.launch_server` arguments (after the interpreter) of a stock server on loopback."""
    return [
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *(extra_args or []),
    ]


def log_tail(log: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@contextmanager
def sglang_process(
    argv: list[str],
    *,
    url: str,
    log: Path,
    python: str = sys.executable,
    env: dict[str, str] | None = None,
    start_timeout_s: float = START_TIMEOUT_S,
) -> Iterator[str]:
    """Run `python argv...` as its own process group, appending to `log`; yield `url` once its `/health` answers
    200; stop the whole group afterwards, also on an exception or Ctrl-C."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        server = subprocess.Popen(
            [python, *argv],
            env={**os.environ, **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_healthy(url, server, log, timeout_s=start_timeout_s)
        yield url
    finally:
        stop_process_group(server)


def wait_healthy(url: str, server: subprocess.Popen, log: Path, *, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if server.poll() is not None:
            raise SGLangServerError(
                f"SGLang exited with code {server.returncode} before it was healthy; {log} ends:\n{log_tail(log)}"
            )
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SGLangServerError(f"SGLang not healthy after {timeout_s:.0f} s; {log} ends:\n{log_tail(log)}")
        time.sleep(1)


def stop_process_group(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, then SIGKILL to whatever of it is left (the group id stays the
    leader's pid, so children that outlive the leader are reached too)."""
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with suppress(subprocess.TimeoutExpired):
        process.wait(timeout=60)
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
