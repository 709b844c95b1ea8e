"""A real `eagle3 worker` whose broker goes away while it holds a message it has not started (here a retry waiting
for its countdown): Redis killed and started again on its append-only file. Celery drops such messages on a lost
connection and they would wait in the broker's unacknowledged set for the visibility timeout (4 hours); their lease
goes back to the reaper instead, which returns the message to the queue within a lease period (production defaults,
not shortened), and the worker stays up through the reconnect."""

import os
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery

from shared.lifecycle import leases
from shared.lifecycle.queue import SHARD_QUEUE, task_name
from shared.settings import Settings
from tests.fixtures.processes import free_port, start_worker, wait_until

pytestmark = pytest.mark.slow

UNACKED = "unacked"  # kombu's Redis hash of delivered, unacknowledged messages


class RestartableRedis:
    """A redis-server with its append-only file on (as the compose file and the manifests run it), killed with
    SIGKILL and started again on the same port and folder."""

    def __init__(self, folder: Path) -> None:
        self.port = free_port()
        self.folder = folder
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        argv += ["--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.folder)]
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
        wait_until(lambda: redis.Redis.from_url(self.url).ping(), timeout_s=10)

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait(timeout=10)


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[RestartableRedis]:
    server = RestartableRedis(tmp_path)
    server.start()
    try:
        yield server
    finally:
        if server.process is not None and server.process.poll() is None:
            server.kill()


def lease_acquired_at(client: redis.Redis, lease_id: str) -> float | None:
    value = client.hget(f"{leases.LEASE_PREFIX}{lease_id}", "acquired_at")
    return None if value is None else float(value)


def test_a_waiting_retry_goes_back_to_the_queue_after_a_broker_restart(
    broker: RestartableRedis, tmp_path: Path
) -> None:
    settings = Settings(_env_file=None)  # the production lease period and reaper interval
    name = f"reconnect-{uuid.uuid4().hex[:8]}@{socket.gethostname()}"
    heartbeat = tmp_path / "heartbeat"
    env = {
        **os.environ,
        "EAGLE3_REDIS_URL": broker.url,
        "EAGLE3_STORAGE_URL": (tmp_path / "storage").as_uri(),
        "EAGLE3_WORKER_HEARTBEAT_FILE": str(heartbeat),
    }
    for variable in ("EAGLE3_SHARD_LEASE_S", "EAGLE3_LEASE_REAPER_INTERVAL_S", "EAGLE3_VISIBILITY_TIMEOUT_S"):
        env.pop(variable, None)
    log_path = tmp_path / "worker.log"
    client = redis.Redis.from_url(broker.url, socket_timeout=5)
    sender = Celery(broker=broker.url)
    job_args = ["job-20260101-000000-deadbeef", 0]
    lease_id = leases.lease_id(task_name("extract"), str(job_args[0]), int(job_args[1]))
    with log_path.open("wb") as log:
        process = start_worker(name, env, tmp_path, log)
        try:
            wait_until(heartbeat.exists, timeout_s=60)  # consuming
            # A shard whose retry countdown has not run out: the worker holds it, unacknowledged, without running it.
            sender.send_task(task_name("extract"), args=job_args, queue=SHARD_QUEUE, countdown=3600)
            wait_until(lambda: client.hlen(UNACKED) == 1 and lease_acquired_at(client, lease_id), timeout_s=30)
            first_delivery = lease_acquired_at(client, lease_id)

            broker.kill()
            time.sleep(5)  # the worker notices: its consumer restarts and waits for the broker
            broker.start()
            # Returned to the queue and delivered again (to this worker, the only one): the lease is taken anew.
            deadline_s = settings.shard_lease_s + 2 * settings.lease_reaper_interval_s + 30
            wait_until(lambda: (lease_acquired_at(client, lease_id) or 0) > (first_delivery or 0), timeout_s=deadline_s)
            alive = process.poll() is None
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGQUIT)
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            sender.close()
    output = log_path.read_text()
    assert alive, f"the worker exited across the broker restart: {output[-3000:]}"
    assert "Unrecoverable error" not in output, output[-3000:]
    assert "was waiting in this worker when the broker connection was lost" in output, output[-3000:]
