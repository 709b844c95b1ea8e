"""`eagle3 up` supervises like compose's restart policy: a dead process is restarted, the rest go on, Ctrl-C stops
everything. Real processes (Redis, the reference server with the tiny model, two workers, the producer)."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.fixtures.processes import default_sigint, free_port, kill_if_running, wait_until

pytestmark = pytest.mark.slow
REPO_ROOT = Path(__file__).resolve().parents[2]


def stack_process(up: psutil.Process, marker: str) -> psutil.Process:
    """The child of `eagle3 up` whose command line contains `marker`."""
    matches = [p for p in up.children() if marker in " ".join(p.cmdline())]
    assert len(matches) == 1, [p.cmdline() for p in up.children()]
    return matches[0]


def test_up_restarts_a_dead_worker_and_keeps_the_rest(tiny_model_dir: Path, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "EAGLE3_HOME": str(tmp_path / "home"),
        "EAGLE3_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
        "EAGLE3_MODEL_PATH": str(tiny_model_dir),
        "EAGLE3_INFERENCE_PORT": str(free_port()),
        "EAGLE3_INFERENCE_DEVICE": "cpu",
        "EAGLE3_API_PORT": str(free_port()),
        "EAGLE3_WORKER_HEARTBEAT_FILE": str(tmp_path / "heartbeat"),
        "EAGLE3_SOFT_SHUTDOWN_TIMEOUT_S": "2",
    }
    terminal = tmp_path / "terminal.txt"
    with terminal.open("wb") as out:
        up = subprocess.Popen(
            [sys.executable, "-m", "eagle3", "up", "--workers", "2"],
            cwd=REPO_ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=default_sigint,
        )
    try:
        wait_until(lambda: "stack up" in terminal.read_text() or up.poll() is not None, timeout_s=240)
        assert up.poll() is None, terminal.read_text()
        parent = psutil.Process(up.pid)
        before = {m: stack_process(parent, m).pid for m in ("worker-2@", "services.inference", "services.producer")}
        victim = stack_process(parent, "worker-1@")
        os.killpg(victim.pid, signal.SIGKILL)  # main process and pool: what docker kill does

        wait_until(lambda: "worker-1 restarted" in terminal.read_text(), timeout_s=60)
        text = terminal.read_text()
        assert "worker-1 exited with code -9; restarting it in 1s" in text, text
        assert stack_process(parent, "worker-1@").pid != victim.pid
        assert {m: stack_process(parent, m).pid for m in before} == before  # the others went on

        up.send_signal(signal.SIGINT)  # Ctrl-C
        assert up.wait(timeout=120) == 0
        assert "stopped" in terminal.read_text()
        for pid in [*before.values()]:
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    finally:
        kill_if_running(up)
