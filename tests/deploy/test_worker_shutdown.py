"""A real `eagle3 worker` stopped the way Docker and Kubernetes stop it (SIGTERM, remapped to Celery's soft
shutdown): an idle worker exits at once, without waiting out EAGLE3_SOFT_SHUTDOWN_TIMEOUT_S, and what it held
unacknowledged (here a retry waiting for its countdown) goes back on the queue, not into the visibility timeout. A
worker whose broker went silent still stops, once the broker has been silent for EAGLE3_REDIS_OUTAGE_WAIT_S."""

import json
import os
import signal
import socket
import time
import uuid
from pathlib import Path

import redis
from celery import Celery

from services.worker.shutdown import EXIT_BROKER_SILENT
from shared.lifecycle.queue import SHARD_QUEUE, task_name
from shared.settings import Settings
from tests.fixtures.processes import kill_if_running, start_worker, wait_until
from tests.fixtures.silent_proxy import SilentProxy

UNACKED = "unacked"  # kombu's Redis hash of delivered, unacknowledged messages
WATCHDOG_MARGIN_S = 30  # pings every 2 s of 2 s each, then the exit


def queued_task_names(client: redis.Redis) -> list[str]:
    return [json.loads(m)["headers"]["task"] for m in client.lrange(SHARD_QUEUE, 0, -1)]


def worker_env(redis_url: str, tmp_path: Path) -> dict[str, str]:
    env = {
        **os.environ,
        "EAGLE3_REDIS_URL": redis_url,
        "EAGLE3_STORAGE_URL": (tmp_path / "storage").as_uri(),
        "EAGLE3_WORKER_HEARTBEAT_FILE": str(tmp_path / "heartbeat"),
        "REMAP_SIGTERM": "SIGQUIT",  # as docker/Dockerfile sets it
    }
    for production_default in ("EAGLE3_SOFT_SHUTDOWN_TIMEOUT_S", "EAGLE3_REDIS_OUTAGE_WAIT_S"):
        env.pop(production_default, None)
    return env


def test_idle_worker_exits_without_the_soft_timeout_and_requeues_a_held_retry(redis_url: str, tmp_path: Path) -> None:
    soft_timeout_s = Settings(_env_file=None).soft_shutdown_timeout_s  # the production default, not shortened
    name = f"shutdown-{uuid.uuid4().hex[:8]}@{socket.gethostname()}"
    heartbeat = tmp_path / "heartbeat"
    env = worker_env(redis_url, tmp_path)
    log_path = tmp_path / "worker.log"
    client = redis.Redis.from_url(redis_url)
    sender = Celery(broker=redis_url)
    with log_path.open("wb") as log:
        process = start_worker(name, env, tmp_path, log)
        try:
            wait_until(heartbeat.exists, timeout_s=60)  # consuming
            # A shard whose retry countdown has not run out: the worker holds it, unacknowledged, without running it.
            job_args = ["job-20260101-000000-deadbeef", 0]
            sender.send_task(task_name("extract"), args=job_args, queue=SHARD_QUEUE, countdown=3600)
            wait_until(lambda: client.hlen(UNACKED) == 1 and client.llen(SHARD_QUEUE) == 0, timeout_s=30)

            stop_sent = time.monotonic()
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=soft_timeout_s + 30)
            stopped_after_s = time.monotonic() - stop_sent
        finally:
            kill_if_running(process)
            sender.close()
    output = log_path.read_text()
    assert process.returncode == 0, output[-3000:]
    assert "Initiating Soft Shutdown" not in output, output[-3000:]
    assert stopped_after_s < soft_timeout_s, f"an idle worker took {stopped_after_s:.1f}s to stop: {output[-3000:]}"
    # The held shard is back on the queue for the next worker, and nothing is left unacknowledged.
    assert queued_task_names(client) == [task_name("extract")]
    assert client.hlen(UNACKED) == 0


def test_a_worker_whose_broker_went_silent_still_stops(redis_url: str, tmp_path: Path) -> None:
    """The broker stops answering without closing anything (a partition, its node gone, its Service deleted before the
    worker's pod), then the worker is told to stop. Without socket timeouts on the broker connection and the shutdown
    watchdog, Celery's shutdown waited on it indefinitely (a pod waited out its 7-minute grace period). Now Celery's
    own shutdown gets through on the timeouts, or, where its event loop is held by a retrying publish, the watchdog
    ends the process once the broker has been silent for the outage wait, saying why."""
    outage_wait_s = Settings(_env_file=None).redis_outage_wait_s  # the production default, not shortened
    proxy = SilentProxy(redis_url)
    heartbeat = tmp_path / "heartbeat"
    log_path = tmp_path / "worker.log"
    env = worker_env(proxy.url, tmp_path)
    with log_path.open("wb") as log:
        process = start_worker(f"silent-{uuid.uuid4().hex[:8]}@{socket.gethostname()}", env, tmp_path, log)
        try:
            wait_until(heartbeat.exists, timeout_s=60)  # consuming, through the proxy
            proxy.silence()
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=outage_wait_s + WATCHDOG_MARGIN_S)  # TimeoutExpired: still waiting on the broker
        finally:
            kill_if_running(process)
            proxy.close()
    output = log_path.read_text()
    assert process.returncode in (0, EXIT_BROKER_SILENT), output[-3000:]
    if process.returncode == EXIT_BROKER_SILENT:
        assert "stopping without the broker" in output, output[-3000:]
