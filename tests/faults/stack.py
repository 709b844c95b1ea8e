"""The stack the fault scenarios break: real processes (`LocalStack`: Redis, the reference inference server with
SmolLM2, `eagle3 worker` processes, the producer API) on SeaweedFS S3, with every delivery setting at its default
(visibility timeout 4 h, shard lease 60 s, reaper every 15 s)."""

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import redis

from eagle3.local_stack import LocalStack
from shared.lifecycle import leases, progress
from shared.lifecycle.schemas import Progress
from shared.settings import Settings
from shared.storage import layout
from shared.storage.objects import Storage


class FaultStack:
    def __init__(self, stack: LocalStack, settings: Settings, storage: Storage) -> None:
        self.stack, self.settings, self.storage = stack, settings, storage
        self.redis = redis.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=2)
        self.api = stack.api_client(timeout_s=300)  # with the stack's API token

    def submit(self, dataset: Path, **spec: object) -> dict:
        response = self.api.post("/v1/jobs", json={"dataset_url": str(dataset), **spec})
        assert response.status_code == 201, response.text
        return response.json()["job"]

    def progress(self, job_id: str) -> Progress:
        return progress.job_progress(self.redis, job_id)

    def wait(self, job_id: str, *, timeout_s: float = 600, supervise: bool = True) -> Progress:
        """Until the job finishes; `supervise` restarts dead processes meanwhile, as `eagle3 up` does."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if supervise:
                self.stack.supervise()
            try:
                p = self.progress(job_id)
                if p.finished:
                    return p
            except redis.RedisError:
                pass  # Redis is down in some scenarios; the supervisor restarts it
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} not finished after {timeout_s}s: {self.progress(job_id)}")

    def worker_logs(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.stack.log_dir.glob("worker-*.log")))

    def process(self, name: str) -> subprocess.Popen:
        return dict(self.stack.processes)[name]

    def name_of_pid(self, pid: int) -> str | None:
        return next((name for name, p in self.stack.processes if p.pid == pid), None)

    def committed(self, job_id: str) -> set[int]:
        return {layout.shard_index_from_manifest_key(k) for k in self.storage.list(layout.manifests_prefix(job_id))}

    def started_samples(self, job_id: str) -> set[int]:
        return {int(k.rsplit("data_", 1)[1].removesuffix(".pt")) for k in self.storage.list(f"{job_id}/rows_")}

    def lease_mid_shard(self, job_id: str, *, worker: str | None = None, timeout_s: float = 300) -> leases.Lease:
        """Wait until a worker (the one named, or any) holds the lease of a shard that has written sample files
        but no manifest yet: the moment to kill it."""
        shard_of: dict[int, int] = {}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for lease in leases.held(self.redis):
                if lease.job_id != job_id or (worker and self.holder_name(lease) != worker):
                    continue
                if lease.shard_index not in shard_of.values():
                    shard = self.storage.get(layout.shard_input(job_id, lease.shard_index))
                    for index in _sample_indices(shard):
                        shard_of[index] = lease.shard_index
                written = {shard_of.get(i) for i in self.started_samples(job_id)}
                if lease.shard_index in written and lease.shard_index not in self.committed(job_id):
                    return lease
            time.sleep(0.05)
        raise TimeoutError(f"no worker was mid-shard in job {job_id} within {timeout_s}s")

    def holder_name(self, lease: leases.Lease) -> str | None:
        return self.name_of_pid(int(lease.holder.split(":")[1]))

    def kill_whole(self, name: str) -> float:
        """SIGKILL a process and its children at once (a lost node, an OOM kill, docker kill); returns the time."""
        process = self.process(name)
        os.killpg(process.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        process.wait()
        return killed_at

    def stop(self, name: str, sig: signal.Signals) -> float:
        """Send `sig` to a process alone and wait for it to exit; returns when the signal was sent."""
        process = self.process(name)
        process.send_signal(sig)
        sent_at = time.monotonic()
        process.wait()
        return sent_at

    def kill_pool_child(self, name: str) -> float:
        children = psutil.Process(self.process(name).pid).children()
        assert children, f"{name} has no pool process"
        children[0].kill()
        return time.monotonic()

    def wait_running_again(self, lease: leases.Lease, *, timeout_s: float, supervise: bool = False) -> float:
        """Until a later delivery takes the lease of `lease`'s shard (it runs again); returns the time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if supervise:
                self.stack.supervise()
            for other in leases.held(self.redis):
                same_shard = (other.job_id, other.shard_index) == (lease.job_id, lease.shard_index)
                if same_shard and other.acquired_at > lease.acquired_at:
                    return time.monotonic()
            if lease.shard_index in self.committed(lease.job_id):  # ran again and finished between two looks
                return time.monotonic()
            time.sleep(0.1)
        raise TimeoutError(f"shard {lease.shard_index} of {lease.job_id} not running again after {timeout_s}s")

    def wait_committed(self, job_id: str, shard_index: int, *, timeout_s: float) -> float:
        wait_for(lambda: shard_index in self.committed(job_id), timeout_s, f"shard {shard_index} committed")
        return time.monotonic()


def _sample_indices(shard_json: bytes) -> list[int]:
    return [s["sample_index"] for s in json.loads(shard_json)["samples"]]


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.1) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (redis.RedisError, httpx.HTTPError):
            pass
        time.sleep(interval_s)
    raise TimeoutError(f"{what}: not within {timeout_s}s")
