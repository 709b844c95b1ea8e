"""Faults of what the workers depend on, over real processes: Redis killed (with and without persistence), the
inference server killed mid-request, the producer killed mid-submit."""

import contextlib
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
import redis

from shared import layout
from shared.demo_data import write_demo_dataset
from shared.schemas import Manifest
from tests.faults.audit import audit_job
from tests.faults.conftest import MakeStack
from tests.faults.fault_proxy import fault_proxy
from tests.faults.stack import FaultStack, wait_for
from tests.fixtures.processes import free_port

pytestmark = [pytest.mark.faults, pytest.mark.slow]

SHARD_TOKENS = 1500


def wait_next_commit(stack: FaultStack, job_id: str, *, timeout_s: float = 300) -> float:
    """Until a shard not committed now is committed; returns the time."""
    before = stack.committed(job_id)
    wait_for(lambda: stack.committed(job_id) - before, timeout_s, "a new shard committed")
    return time.monotonic()


def test_redis_killed_and_restarted_with_append_only_file(make_stack: MakeStack, chats: Path, fault_table) -> None:
    row = fault_table("Redis SIGKILL + restart, AOF on")
    with make_stack(workers=2) as stack:  # the stack starts Redis with appendonly yes, as compose does
        job_id = stack.submit(chats, shard_token_budget=SHARD_TOKENS)["job_id"]
        stack.lease_mid_shard(job_id)
        killed_at = stack.kill_whole("redis")
        stack.stack.supervise()
        wait_for(lambda: stack.stack.supervise() is not None and stack.redis.ping(), 60, "Redis restarted")
        row.recover_s = wait_next_commit(stack, job_id) - killed_at
        p = stack.wait(job_id)
        row.audit, row.reruns = audit_job(stack.storage, job_id), p.shards_rerun
    assert row.audit.clean, row.audit.explain()
    assert (p.state, p.samples_done) == ("completed", p.samples_total), p


@pytest.fixture
def volatile_redis(tmp_path: Path) -> Iterator[tuple[str, list[subprocess.Popen]]]:
    """A redis-server without any persistence; the list holds the running process (the test restarts it)."""
    port = free_port()
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    argv += ["--dir", str(tmp_path)]
    processes = [subprocess.Popen(argv, stdout=subprocess.DEVNULL)]
    url = f"redis://127.0.0.1:{port}/0"
    wait_for(lambda: redis.Redis.from_url(url).ping(), 10, "redis-server up")
    yield url, processes
    for process in processes:
        process.kill()
        process.wait()


def test_redis_lost_without_persistence_job_resumed_from_storage(
    make_stack: MakeStack, chats: Path, volatile_redis: tuple[str, list[subprocess.Popen]], fault_table
) -> None:
    row = fault_table("Redis SIGKILL + restart empty (no persistence), eagle3 resume")
    url, processes = volatile_redis
    with make_stack(workers=2, redis_url=url) as stack:
        job_id = stack.submit(chats, shard_token_budget=SHARD_TOKENS)["job_id"]
        stack.lease_mid_shard(job_id)
        processes[0].kill()
        killed_at = time.monotonic()
        processes[0].wait()
        processes.append(subprocess.Popen(processes[0].args, stdout=subprocess.DEVNULL))
        wait_for(lambda: stack.redis.ping(), 10, "empty Redis up")
        assert not stack.redis.exists(f"eagle3:job:{job_id}")  # the job, its queue and its leases are gone
        # Storage is the truth: resume recounts the committed shards and queues the rest.
        wait_for(lambda: stack.api.post(f"/v1/jobs/{job_id}/resume").status_code == 200, 60, "resume accepted")
        row.recover_s = wait_next_commit(stack, job_id) - killed_at
        p = stack.wait(job_id, supervise=False)
        row.audit, row.reruns = audit_job(stack.storage, job_id), p.shards_rerun
    assert row.audit.clean, row.audit.explain()
    assert (p.state, p.samples_done, p.tokens_done) == ("completed", p.samples_total, p.tokens_total), p


def test_inference_server_killed_mid_request_and_restarted(make_stack: MakeStack, chats: Path, fault_table) -> None:
    row = fault_table("inference server SIGKILL mid-request, restarted")
    with make_stack(workers=2) as stack:
        job_id = stack.submit(chats, shard_token_budget=SHARD_TOKENS)["job_id"]
        lease = stack.lease_mid_shard(job_id)
        stack.kill_whole("inference")
        killed_at = datetime.now(UTC)
        # The supervisor restarts the server; a shard's retry waits until it is ready again instead of failing.
        p = stack.wait(job_id)
        manifest = Manifest.model_validate_json(stack.storage.get(layout.manifest(job_id, lease.shard_index)))
        row.recover_s = (datetime.fromisoformat(manifest.committed_at) - killed_at).total_seconds()
        row.audit, row.reruns = audit_job(stack.storage, job_id), p.shards_rerun
    assert row.audit.clean, row.audit.explain()
    assert (p.state, p.samples_done, p.shards_dead_lettered) == ("completed", p.samples_total, 0), p


def test_producer_killed_mid_submit_leaves_no_half_job(make_stack: MakeStack, tmp_path: Path, fault_table) -> None:
    row = fault_table("producer SIGKILL mid-submit")
    # One conversation per shard: planning writes many input files, a wide window to kill the producer in.
    dataset = write_demo_dataset(tmp_path / "small.jsonl", num_conversations=24, seed=1)
    spec = {"dataset_url": str(dataset), "shard_token_budget": 64, "job_id": "job-faults-mid-submit"}
    with make_stack(workers=2) as stack:
        inputs = f"{spec['job_id']}/inputs/"
        submit = threading.Thread(target=lambda: _post_ignoring_errors(stack.api, spec), daemon=True)
        submit.start()
        wait_for(lambda: stack.storage.list(inputs), 120, "planning started", interval_s=0.01)
        killed_at = stack.kill_whole("producer")
        submit.join(timeout=30)
        planned = stack.storage.exists(layout.job_json(spec["job_id"]))
        wait_for(lambda: stack.stack.supervise() is not None and stack.api.get("/health").status_code == 200, 60, "up")
        if not planned:  # absent: no job record, nothing queued; submitting again plans it whole
            assert stack.api.get(f"/v1/jobs/{spec['job_id']}").status_code == 404
            assert stack.api.post("/v1/jobs", json=spec).status_code == 201
        else:  # planned whole (job.json is written last); resume queues any shard not yet enqueued
            assert stack.api.post(f"/v1/jobs/{spec['job_id']}/resume").status_code == 200
        p = stack.wait(spec["job_id"])
        row.recover_s = time.monotonic() - killed_at
        row.note = "killed before job.json: absent, resubmitted" if not planned else "killed after job.json: resumed"
        row.audit, row.reruns = audit_job(stack.storage, spec["job_id"]), p.shards_rerun
    assert row.audit.clean, row.audit.explain()
    assert (p.state, p.samples_done) == ("completed", p.samples_total), p


def _post_ignoring_errors(api: httpx.Client, spec: dict) -> None:
    with contextlib.suppress(httpx.HTTPError):  # the producer is killed under this request
        api.post("/v1/jobs", json=spec)


HANG_TIMEOUT_S = 20.0  # EAGLE3_INFERENCE_TIMEOUT_S for this scenario only (default 300 s): one hang, not five minutes


def test_inference_server_that_hangs_times_out_and_recovers(make_stack: MakeStack, chats: Path, fault_table) -> None:
    row = fault_table(f"inference hangs 45 s (request timeout {HANG_TIMEOUT_S:.0f} s)")
    with (
        make_stack(workers=0, inference_timeout_s=HANG_TIMEOUT_S) as stack,
        fault_proxy(stack.stack.env["EAGLE3_INFERENCE_URL"]) as proxy,
    ):
        # The workers reach the server through the proxy; the producer does not call it.
        stack.stack.env = {**stack.stack.env, "EAGLE3_INFERENCE_URL": proxy.endpoint_url}
        for _ in range(2):
            stack.stack.add_worker()
        job_id = stack.submit(chats, shard_token_budget=SHARD_TOKENS)["job_id"]
        stack.lease_mid_shard(job_id)
        proxy.fault = "hang"
        wait_for(lambda: proxy.injected >= 2, 60, "requests hanging")
        hung = proxy.injected
        time.sleep(45)  # more than two request timeouts: the workers time out, back off and try again
        retried_during_hang = proxy.injected - hung
        proxy.fault = "none"
        released = time.monotonic()
        row.recover_s = wait_next_commit(stack, job_id) - released
        p = stack.wait(job_id, supervise=False)
        if p.state == "completed_with_errors":
            assert stack.api.post(f"/v1/jobs/{job_id}/resume").status_code == 200
            row.note = f"{p.shards_dead_lettered} shard(s) dead-lettered during the hang; resumed"
            p = stack.wait(job_id, supervise=False)
        row.audit, row.reruns = audit_job(stack.storage, job_id), p.shards_rerun
    assert retried_during_hang > 0  # no worker waited on a hung request forever: they timed out and retried
    assert row.audit.clean, row.audit.explain()
    assert (p.state, p.samples_done) == ("completed", p.samples_total), p
