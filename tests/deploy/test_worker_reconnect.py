"""A real `eagle3 worker` whose broker goes away while it holds a message it has not started (here a retry waiting
for its countdown): Redis killed and started again on its append-only file. Celery drops such messages on a lost
connection and they would wait in the broker's unacknowledged set for the visibility timeout (4 hours); their lease
goes back to the reaper instead, which returns the message to the queue within a lease period (production defaults,
not shortened), and the worker stays up through the reconnect. A delivery Redis recorded but whose lease it never
got (killed in between) is returned by the reaper's sweep of the unacknowledged set, also within a lease period."""

import contextlib
import os
import signal
import socket
import subprocess
import threading
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
from shared.storage import layout
from shared.storage.objects import open_storage
from tests.fixtures.processes import free_port, start_worker, wait_until

pytestmark = pytest.mark.slow

UNACKED = "unacked"  # kombu's Redis hash of delivered, unacknowledged messages


class RestartableRedis:
    """A redis-server persisted as the compose file and the manifests run it (append-only file, fsync every second),
    killed with SIGKILL and started again on the same port and folder."""

    def __init__(self, folder: Path) -> None:
        self.port = free_port()
        self.folder = folder
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        argv += ["--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(self.folder)]
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


def worker_env(redis_url: str, tmp_path: Path) -> dict[str, str]:
    """A worker's environment with the production lease period, reaper interval and visibility timeout."""
    env = {
        **os.environ,
        "EAGLE3_REDIS_URL": redis_url,
        "EAGLE3_STORAGE_URL": (tmp_path / "storage").as_uri(),
        "EAGLE3_WORKER_HEARTBEAT_FILE": str(tmp_path / "heartbeat"),
    }
    for variable in ("EAGLE3_SHARD_LEASE_S", "EAGLE3_LEASE_REAPER_INTERVAL_S", "EAGLE3_VISIBILITY_TIMEOUT_S"):
        env.pop(variable, None)
    return env


def stop_worker(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGQUIT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_a_waiting_retry_goes_back_to_the_queue_after_a_broker_restart(
    broker: RestartableRedis, tmp_path: Path
) -> None:
    settings = Settings(_env_file=None)  # the production lease period and reaper interval
    name = f"reconnect-{uuid.uuid4().hex[:8]}@{socket.gethostname()}"
    env = worker_env(broker.url, tmp_path)
    log_path = tmp_path / "worker.log"
    client = redis.Redis.from_url(broker.url, socket_timeout=5)
    sender = Celery(broker=broker.url)
    job_args = ["job-20260101-000000-deadbeef", 0]
    lease_id = leases.lease_id(task_name("extract"), str(job_args[0]), int(job_args[1]))
    with log_path.open("wb") as log:
        process = start_worker(name, env, tmp_path, log)
        try:
            wait_until((tmp_path / "heartbeat").exists, timeout_s=60)  # consuming
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
            stop_worker(process)
            sender.close()
    output = log_path.read_text()
    assert alive, f"the worker exited across the broker restart: {output[-3000:]}"
    assert "Unrecoverable error" not in output, output[-3000:]
    assert "was waiting in this worker when the broker connection was lost" in output, output[-3000:]


# kombu records a delivery in one pipeline (ZADD unacked_index, HSET unacked): the HSET, as redis-py writes it.
RECORD_DELIVERY = b"$4\r\nHSET\r\n$7\r\nunacked\r\n"


class DeliveryCutProxy:
    """A TCP proxy between the worker and Redis that stops passing on what the worker sends as soon as it has passed
    kombu's record of the first delivery: whatever the worker sends next (the shard's lease) never reaches Redis,
    which the test kills there. This is the Redis SIGKILL that lands between a delivery and its lease, made
    deterministic; once the test lifts the cut, everything passes."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.delivery_recorded = threading.Event()
        self.cut = False  # while set, the worker's commands are swallowed
        self.listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):  # closed by stop()
            while True:
                worker_side, _ = self.listener.accept()
                try:
                    redis_side = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
                except OSError:  # Redis is down: the worker sees the connection refused
                    worker_side.close()
                    continue
                redis_side.settimeout(None)
                threading.Thread(target=self._pass_commands, args=(worker_side, redis_side), daemon=True).start()
                threading.Thread(target=self._pass_replies, args=(redis_side, worker_side), daemon=True).start()

    def _pass_commands(self, worker_side: socket.socket, redis_side: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := worker_side.recv(65536):
                if self.cut:
                    continue
                redis_side.sendall(data)
                if RECORD_DELIVERY in data and not self.delivery_recorded.is_set():  # the first delivery only
                    self.cut = True
                    self.delivery_recorded.set()
        _close(worker_side, redis_side)

    def _pass_replies(self, redis_side: socket.socket, worker_side: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := redis_side.recv(65536):
                worker_side.sendall(data)
        _close(worker_side, redis_side)

    def stop(self) -> None:
        self.listener.close()


def _close(*sockets: socket.socket) -> None:
    for each in sockets:
        with contextlib.suppress(OSError):
            each.shutdown(socket.SHUT_RDWR)
        each.close()


def test_a_delivery_whose_lease_redis_never_got_goes_back_to_the_queue(
    broker: RestartableRedis, tmp_path: Path
) -> None:
    """Redis SIGKILLed after it recorded the delivery of a countdown retry (kombu's `unacked` hash) and before the
    worker's lease reached it: restarted from its append-only file, Redis holds the message as delivered and no lease
    for it, so neither the lease reaper nor the visibility timeout (4 hours) would return it soon. The reaper's sweep
    of the unacknowledged set does, once the delivery is a lease period old (production settings)."""
    settings = Settings(_env_file=None)
    proxy = DeliveryCutProxy(broker.port)
    name = f"stranded-{uuid.uuid4().hex[:8]}@{socket.gethostname()}"
    log_path = tmp_path / "worker.log"
    client = redis.Redis.from_url(broker.url, socket_timeout=5)
    sender = Celery(broker=broker.url)  # straight to Redis, past the proxy
    job_id, shard_index = "job-20260101-000000-0ddba11", 1
    open_storage((tmp_path / "storage").as_uri()).put(layout.job_json(job_id), b"{}")  # the job exists
    lease_id = leases.lease_id(task_name("regenerate"), job_id, shard_index)
    with log_path.open("wb") as log:
        process = start_worker(name, worker_env(proxy.url, tmp_path), tmp_path, log)
        try:
            wait_until((tmp_path / "heartbeat").exists, timeout_s=60)  # consuming
            sender.send_task(task_name("regenerate"), args=[job_id, shard_index], queue=SHARD_QUEUE, countdown=3600)
            assert proxy.delivery_recorded.wait(timeout=30), "the worker never took the message"
            wait_until(lambda: client.hlen(UNACKED) == 1, timeout_s=10)  # Redis has recorded the delivery
            delivered_at = time.time()
            broker.kill()
            time.sleep(5)  # the worker notices: its lease cannot be written, its consumer restarts
            proxy.cut = False
            broker.start()

            # What the soak found: the message delivered and unacknowledged, and no lease that a reaper would expire.
            assert client.hlen(UNACKED) == 1 and not client.exists(leases.LEASE_PREFIX + lease_id)
            # Returned to the queue and delivered again to this worker, which leases it this time.
            deadline_s = settings.shard_lease_s + 2 * settings.lease_reaper_interval_s + 30
            wait_until(lambda: lease_acquired_at(client, lease_id), timeout_s=deadline_s)
            returned_after_s = time.time() - delivered_at
            assert client.hlen(UNACKED) == 1  # the same message, once: restored, not copied
            alive = process.poll() is None
        finally:
            stop_worker(process)
            sender.close()
            proxy.stop()
    output = log_path.read_text()
    assert alive, f"the worker exited across the broker restart: {output[-3000:]}"
    assert f"cannot lease shard {shard_index} of job {job_id}" in output, output[-3000:]
    assert f"shard {shard_index} of job {job_id} was delivered" in output, output[-3000:]
    assert returned_after_s >= settings.shard_lease_s, returned_after_s
