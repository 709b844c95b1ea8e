"""Inference servers as child processes: SGLang (`eagle3 eval --engine sglang`, the GPU demo, the SGLang
benchmarks) or the reference server (the benchmarks). Each is launched as its own process group, is healthy before
it is used, and is stopped with every process it started (SGLang's scheduler and detokenizer are its children).
A server that dies or never becomes healthy raises with the end of its log, so the reason (an unknown flag, out of
memory, a bad draft model folder) is on the screen.
"""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from shared.errors import Eagle3Error

# Compiling kernels and capturing CUDA graphs (target, draft and verify graphs with EAGLE-3) at first start.
START_TIMEOUT_S = 900.0
LOG_TAIL_LINES = 25
# After SIGKILL: how long the group's processes may take to be scheduled and die.
GROUP_EXIT_TIMEOUT_S = 10.0


class ServerProcessError(Eagle3Error):
    """A server this process launched exited or did not become healthy."""


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


@dataclass(frozen=True)
class ServerLaunch:
    """How to start one server: `python argv...`, answering at `url`, appending to `log`."""

    argv: list[str]
    url: str
    log: Path
    env: dict[str, str] = field(default_factory=dict)


def start(launch: ServerLaunch, *, python: str = sys.executable) -> subprocess.Popen:
    """The server as its own process group (it is stopped as a group)."""
    launch.log.parent.mkdir(parents=True, exist_ok=True)
    with launch.log.open("ab") as out:
        return subprocess.Popen(
            [python, *launch.argv],
            env={**os.environ, **launch.env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@contextmanager
def server_processes(
    launches: list[ServerLaunch], *, python: str = sys.executable, start_timeout_s: float = START_TIMEOUT_S
) -> Iterator[list[str]]:
    """Start every server at once (their minutes of kernel compilation and graph capture overlap), yield their
    URLs once each answers `/health`, and stop them all afterwards, also on an exception or Ctrl-C."""
    servers: list[subprocess.Popen] = []
    try:
        for launch in launches:
            servers.append(start(launch, python=python))
        for launch, server in zip(launches, servers, strict=True):
            wait_healthy(launch.url, server, launch.log, timeout_s=start_timeout_s)
        yield [launch.url for launch in launches]
    finally:
        for server in servers:
            stop_process_group(server)


@contextmanager
def server_process(
    argv: list[str],
    *,
    url: str,
    log: Path,
    python: str = sys.executable,
    env: dict[str, str] | None = None,
    start_timeout_s: float = START_TIMEOUT_S,
) -> Iterator[str]:
    """One server: `python argv...` as its own process group, yielded as its URL once healthy."""
    with server_processes(
        [ServerLaunch(argv, url, log, env or {})], python=python, start_timeout_s=start_timeout_s
    ) as (url_,):
        yield url_


def wait_healthy(url: str, server: subprocess.Popen, log: Path, *, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if server.poll() is not None:
            raise ServerProcessError(
                f"{log.stem} exited with code {server.returncode} before it was healthy; {log} ends:\n{log_tail(log)}"
            )
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise ServerProcessError(f"{log.stem} not healthy after {timeout_s:.0f} s; {log} ends:\n{log_tail(log)}")
        time.sleep(1)


def stop_process_group(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, then SIGKILL to whatever of it is left (the group id stays the
    leader's pid, so children that outlive the leader are reached too), and return once none of it runs: a signal
    is delivered when the process is next scheduled, and a server's scheduler that is still dying holds the GPU
    memory the next server measures at its start."""
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with suppress(subprocess.TimeoutExpired):
        process.wait(timeout=60)
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    deadline = time.monotonic() + GROUP_EXIT_TIMEOUT_S
    while group_running(process.pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def group_running(pgid: int) -> bool:
    """Whether a process of the group still runs. Zombies (dead, waiting for whoever adopted them to reap them) do
    not count; where there is no /proc, a group runs while it can be signalled."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            state, _parent, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):  # a process that ended while the folder was read
            continue
        if int(group) == pgid and state != "Z":
            return True
    return False
