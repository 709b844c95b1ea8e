"""The worker liveness probe (`eagle3 worker-probe`): fresh while a real worker consumes, stale once it is connected
to Redis but no longer consuming, fresh again when it resumes."""

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery

from shared.lifecycle.queue import SHARD_QUEUE
from tests.fixtures.processes import start_worker, wait_until

INTERVAL_S = 0.3
MAX_AGE_S = 2.0


def probe(path: Path, max_age_s: float = MAX_AGE_S) -> subprocess.CompletedProcess[str]:
    """The liveness probe exactly as the containers run it (a fresh `eagle3` process)."""
    return subprocess.run(
        [sys.executable, "-m", "eagle3", "worker-probe", "--file", str(path), "--max-age", str(max_age_s)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("age_s", "passes"),
    [pytest.param(0, True, id="fresh"), pytest.param(30, False, id="stale")],
)
def test_probe_judges_the_heartbeat_age(tmp_path: Path, age_s: float, passes: bool) -> None:
    path = tmp_path / "heartbeat"
    path.touch()
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    result = probe(path, max_age_s=10)
    assert (result.returncode == 0) is passes, result.stderr
    if not passes:
        assert "not consuming" in result.stderr


def test_probe_fails_without_a_heartbeat(tmp_path: Path) -> None:
    result = probe(tmp_path / "missing")
    assert result.returncode != 0
    assert "does not exist" in result.stderr


@pytest.fixture
def worker(redis_url: str, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A real `eagle3 worker` on the test Redis: (its Celery node name, its heartbeat file)."""
    name = f"heartbeat-{uuid.uuid4().hex[:8]}@{socket.gethostname()}"
    path = tmp_path / "heartbeat"
    env = {
        **os.environ,
        "EAGLE3_REDIS_URL": redis_url,
        "EAGLE3_STORAGE_URL": (tmp_path / "storage").as_uri(),
        "EAGLE3_WORKER_HEARTBEAT_FILE": str(path),
        "EAGLE3_WORKER_HEARTBEAT_INTERVAL_S": str(INTERVAL_S),
    }
    log = (tmp_path / "worker.log").open("wb")
    process = start_worker(name, env, tmp_path, log)
    try:
        deadline = time.monotonic() + 60
        while not path.exists():  # the heartbeat appears once the worker consumes
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"worker did not start: {(tmp_path / 'worker.log').read_text()[-3000:]}")
            time.sleep(0.1)
        yield name, path
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


@pytest.mark.slow  # a real Celery worker process
def test_probe_fails_while_a_connected_worker_stops_consuming(worker: tuple[str, Path], redis_url: str) -> None:
    name, path = worker
    control = Celery(broker=redis_url)
    try:
        # Idle and consuming (its queue is empty): the heartbeat stays fresh, beat after beat.
        time.sleep(MAX_AGE_S + 2 * INTERVAL_S)
        assert probe(path).returncode == 0

        # The worker stays connected to Redis but stops consuming its queue, while a shard waits there: the
        # failure of celery#8091 after a Redis restart, produced on purpose with a remote-control command.
        replies = control.control.cancel_consumer(SHARD_QUEUE, destination=[name], reply=True, timeout=10)
        assert replies and "ok" in replies[0][name], replies
        control.send_task("tests.deploy.unregistered_task", queue=SHARD_QUEUE)
        wait_until(lambda: probe(path).returncode != 0, timeout_s=MAX_AGE_S + 15)
        assert "not consuming" in probe(path).stderr
        # ... and still answers a broker ping, which is why `celery inspect ping` is no liveness check.
        assert control.control.ping(destination=[name], timeout=5)

        # Consuming again: it takes the waiting message and the heartbeat is fresh again.
        replies = control.control.add_consumer(SHARD_QUEUE, destination=[name], reply=True, timeout=10)
        assert replies and "ok" in replies[0][name], replies
        wait_until(lambda: probe(path).returncode == 0, timeout_s=15)
    finally:
        control.close()
