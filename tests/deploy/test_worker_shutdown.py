"""A real `eagle3 worker` stopped the way Docker and Kubernetes stop it (SIGTERM, remapped to Celery's soft
shutdown): an idle worker exits at once, without waiting out EAGLE3_SOFT_SHUTDOWN_TIMEOUT_S, and what it held
unacknowledged (here a retry waiting for its countdown) goes back on the queue, not into the visibility timeout."""

import json
import os
import signal
import socket
import time
import uuid
from pathlib import Path

import redis
from celery import Celery

from shared.lifecycle.queue import SHARD_QUEUE, task_name
from shared.settings import Settings
from tests.fixtures.processes import start_worker, wait_until

UNACKED = "unacked"  # kombu's Redis hash of delivered, unacknowledged messages


def queued_task_names(client: redis.Redis) -> list[str]:
    return [json.loads(m)["headers"]["task"] for m in client.lrange(SHARD_QUEUE, 0, -1)]


def test_idle_worker_exits_without_the_soft_timeout_and_requeues_a_held_retry(redis_url: str, tmp_path: Path) -> None:
    soft_timeout_s = Settings(_env_file=None).soft_shutdown_timeout_s  # the production default, not shortened
    name = f"shutdown-{uuid.uuid4().hex[:8]}@{socket.gethostname()}"
    heartbeat = tmp_path / "heartbeat"
    env = {
        **os.environ,
        "EAGLE3_REDIS_URL": redis_url,
        "EAGLE3_STORAGE_URL": (tmp_path / "storage").as_uri(),
        "EAGLE3_WORKER_HEARTBEAT_FILE": str(heartbeat),
        "REMAP_SIGTERM": "SIGQUIT",  # as docker/Dockerfile sets it
    }
    env.pop("EAGLE3_SOFT_SHUTDOWN_TIMEOUT_S", None)
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
            if process.poll() is None:
                process.kill()
                process.wait()
            sender.close()
    output = log_path.read_text()
    assert process.returncode == 0, output[-3000:]
    assert "Initiating Soft Shutdown" not in output, output[-3000:]
    assert stopped_after_s < soft_timeout_s, f"an idle worker took {stopped_after_s:.1f}s to stop: {output[-3000:]}"
    # The held shard is back on the queue for the next worker, and nothing is left unacknowledged.
    assert queued_task_names(client) == [task_name("extract")]
    assert client.hlen(UNACKED) == 0
