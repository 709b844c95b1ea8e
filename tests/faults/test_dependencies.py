"""Faults of what the workers depend on, over real processes: Redis killed (with and without persistence), the
inference server killed or hung mid-request, the producer killed mid-submit (planning, before the job's registration,
enqueueing)."""

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
import redis

from shared.data.demo_data import write_demo_dataset
from shared.lifecycle import progress
from shared.lifecycle.schemas import Manifest
from shared.settings import Settings
from shared.storage import layout
from tests.faults.audit import audit_job
from tests.faults.conftest import MakeStack
from tests.faults.fault_proxy import fault_proxy
from tests.faults.stack import FaultStack, wait_for
from tests.fixtures.processes import free_port
from tests.fixtures.seaweedfs import S3Server

pytestmark = [pytest.mark.faults, pytest.mark.slow]

SHARD_TOKENS = 1500
DEFAULTS = Settings(_env_file=None)


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


def test_redis_restarted_gracefully_three_times_mid_job(make_stack: MakeStack, tmp_path: Path, fault_table) -> None:
    """SIGTERM, as `docker compose restart redis` does: Redis saves and closes every connection, and is back in a
    second, while shards are mid-commit. Small shards (as the compose test's) so that several are in flight."""
    row = fault_table("Redis SIGTERM + restart x3 (compose restart), AOF on")
    dataset = write_demo_dataset(tmp_path / "small.jsonl", num_conversations=48, seed=3)
    with make_stack(workers=2) as stack:
        job_id = stack.submit(dataset, shard_token_budget=256)["job_id"]
        recover_s = []
        for _ in range(3):
            stack.lease_mid_shard(job_id)
            stopped_at = stack.stop("redis", signal.SIGTERM)
            wait_for(lambda: stack.stack.supervise() is not None and stack.redis.ping(), 60, "Redis restarted")
            recover_s.append(wait_next_commit(stack, job_id) - stopped_at)
        row.recover_s = max(recover_s)
        p = stack.wait(job_id)
        row.audit, row.reruns = audit_job(stack.storage, job_id), p.shards_rerun
    assert row.audit.clean, row.audit.explain()
    assert (p.state, p.samples_done) == ("completed", p.samples_total), p


def test_redis_down_three_minutes_mid_job_past_the_outage_wait(make_stack: MakeStack, chats: Path, fault_table) -> None:
    """Redis stopped (SIGTERM) while a shard is mid-commit and held down for three times EAGLE3_REDIS_OUTAGE_WAIT_S
    (3 minutes at the default): the shards' Redis calls give up, their shards go back to the lease reaper, and once
    Redis is back on its append-only file the job finishes by itself, every sample committed once."""
    row = fault_table("Redis down 3 min (3x EAGLE3_REDIS_OUTAGE_WAIT_S) mid-job, restarted on its AOF, no manual step")
    outage_s = 3 * DEFAULTS.redis_outage_wait_s
    with make_stack(workers=2) as stack:
        job_id = stack.submit(chats, shard_token_budget=SHARD_TOKENS)["job_id"]
        stack.lease_mid_shard(job_id)
        stopped_at = stack.stop("redis", signal.SIGTERM)
        stack.stack.supervise()  # sees Redis gone and plans its restart after the back-off ...
        stack.stack.restarts["redis"].restart_at = stopped_at + outage_s  # ... held back for the whole outage
        wait_for(lambda: stack.stack.supervise() is not None and stack.redis.ping(), outage_s + 60, "Redis back")
        back_at = time.monotonic()
        assert back_at - stopped_at >= outage_s
        row.recover_s = wait_next_commit(stack, job_id) - back_at
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


def test_redis_lost_without_persistence_job_recovers_by_itself(
    make_stack: MakeStack, chats: Path, volatile_redis: tuple[str, list[subprocess.Popen]], fault_table
) -> None:
    row = fault_table("Redis SIGKILL + restart empty (no persistence), no manual step")
    url, processes = volatile_redis
    with make_stack(workers=2, redis_url=url) as stack:
        job_id = stack.submit(chats, shard_token_budget=SHARD_TOKENS)["job_id"]
        stack.lease_mid_shard(job_id)
        processes[0].kill()
        killed_at = time.monotonic()
        processes[0].wait()
        processes.append(subprocess.Popen(processes[0].args, stdout=subprocess.DEVNULL))
        wait_for(lambda: stack.redis.ping(), 10, "empty Redis up")
        assert not stack.redis.exists(progress.job_key(job_id))  # the job, its queue and its leases are gone
        # No `eagle3 resume`: a worker's reaper finds Redis's state marker gone and recovers the job from storage.
        wait_for(lambda: stack.redis.exists(progress.job_key(job_id)), 120, "the job recovered by a worker")
        row.recover_s = wait_next_commit(stack, job_id) - killed_at
        p = stack.wait(job_id, supervise=False)
        row.audit, row.reruns = audit_job(stack.storage, job_id), p.shards_rerun
        logs = stack.worker_logs()
    assert f"job {job_id} recovered from storage after Redis lost its state" in logs
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


def test_producer_killed_while_planning_leaves_no_half_job(make_stack: MakeStack, tmp_path: Path, fault_table) -> None:
    row = fault_table("producer SIGKILL mid-planning (before job.json)")
    # One conversation per shard: planning writes many input files, a wide window to kill the producer in.
    dataset = write_demo_dataset(tmp_path / "small.jsonl", num_conversations=24, seed=1)
    spec = {"dataset_url": str(dataset), "shard_token_budget": 64, "job_id": "job-faults-mid-planning"}
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
        # else planned whole (job.json is written after every plan file): it finishes by itself, as below
        p = stack.wait(spec["job_id"])
        row.recover_s = time.monotonic() - killed_at
        row.note = "killed before job.json: absent, resubmitted" if not planned else "killed after job.json: finished"
        row.audit, row.reruns = audit_job(stack.storage, spec["job_id"]), p.shards_rerun
    assert row.audit.clean, row.audit.explain()
    assert (p.state, p.samples_done) == ("completed", p.samples_total), p


def test_producer_killed_while_enqueueing_leaves_the_job_to_the_workers(
    make_stack: MakeStack, tmp_path: Path, fault_table
) -> None:
    row = fault_table("producer SIGKILL mid-enqueue (after job.json), no manual step")
    dataset = write_demo_dataset(tmp_path / "small.jsonl", num_conversations=60, seed=2)
    job_id = "job-faults-mid-enqueue"
    spec = {"dataset_url": str(dataset), "shard_token_budget": 64, "job_id": job_id}
    with make_stack(workers=2) as stack:
        key = progress.job_key(job_id)
        submit = threading.Thread(target=lambda: _post_ignoring_errors(stack.api, spec), daemon=True)
        submit.start()

        def enqueued() -> int:
            return int(stack.redis.hget(key, progress.SHARDS_ENQUEUED) or 0)

        # Stop the producer the moment it has enqueued a shard, then kill it: it dies between two enqueues.
        wait_for(lambda: enqueued() >= 1 or not submit.is_alive(), 300, "enqueueing started", interval_s=0)
        os.killpg(stack.process("producer").pid, signal.SIGSTOP)
        assert submit.is_alive(), "the submit ended before the producer could be stopped mid-enqueue"
        killed_at = stack.kill_whole("producer")
        submit.join(timeout=30)
        sent, total = enqueued(), int(stack.redis.hget(key, "shards_total"))
        assert stack.storage.exists(layout.job_json(job_id)) and 0 < sent < total, (sent, total)
        # No resume: a worker's reaper sees the enqueueing stalled for a lease period and enqueues the rest.
        wait_for(lambda: enqueued() == total, 180, "the rest enqueued by a worker")
        row.recover_s = time.monotonic() - killed_at
        p = stack.wait(job_id)
        row.audit, row.reruns = audit_job(stack.storage, job_id), p.shards_rerun
        row.note = f"killed after enqueueing {sent} of {total} shards; a worker enqueued the rest"
        logs = stack.worker_logs()
    assert f"job {job_id}: its producer stopped after enqueueing {sent} of {total} shards" in logs
    assert row.audit.clean, row.audit.explain()
    assert (p.state, p.samples_done, p.shards_dead_lettered) == ("completed", p.samples_total, 0), p


def test_producer_killed_between_job_json_and_registration_leaves_the_job_to_the_workers(
    make_stack: MakeStack, s3_server: S3Server, tmp_path: Path, fault_table
) -> None:
    row = fault_table("producer SIGKILL between job.json and the job's registration, no manual step")
    dataset = write_demo_dataset(tmp_path / "small.jsonl", num_conversations=24, seed=3)
    job_id = "job-faults-before-registration"
    spec = {"dataset_url": str(dataset), "shard_token_budget": 256, "job_id": job_id}
    with fault_proxy(s3_server.endpoint_url) as proxy:

        def hold_job_json_answer(head: bytes) -> None:
            # S3 stores job.json at once; its answer reaches the producer 0.5 s later: the window to kill it in.
            request_line = head.split(b"\r\n", 1)[0]
            slow = request_line.startswith(b"PUT ") and f"/{job_id}/job.json".encode() in request_line
            proxy.fault = "slow" if slow else "none"

        proxy.on_request = hold_job_json_answer
        with make_stack(workers=2, s3_endpoint_url=proxy.endpoint_url) as stack:
            submit = threading.Thread(target=lambda: _post_ignoring_errors(stack.api, spec), daemon=True)
            submit.start()
            wait_for(lambda: stack.storage.exists(layout.job_json(job_id)), 300, "job.json written", interval_s=0)
            os.killpg(stack.process("producer").pid, signal.SIGSTOP)
            killed_at = stack.kill_whole("producer")
            submit.join(timeout=30)
            assert not stack.redis.exists(progress.job_key(job_id)), "the producer registered the job before it died"
            wait_for(
                lambda: stack.stack.supervise() is not None and stack.api.get("/health").status_code == 200, 60, "up"
            )
            # Submitting it again is refused (the job exists) and starts nothing twice.
            again = stack.api.post("/v1/jobs", json=spec)
            assert again.status_code == 409 and "already exists" in again.json()["detail"], again.text
            # No resume: a worker's reaper sees the publishing stalled for a lease period, registers the job and
            # enqueues it whole.
            wait_for(lambda: stack.redis.exists(progress.job_key(job_id)), 180, "the job registered by a worker")
            row.recover_s = time.monotonic() - killed_at
            p = stack.wait(job_id)
            row.audit, row.reruns = audit_job(stack.storage, job_id), p.shards_rerun
            row.note = (
                f"killed with job.json written, the job unregistered; a worker registered it ({p.shards_total} shards)"
            )
            logs = stack.worker_logs()
    assert f"job {job_id}: its submit stopped before the job was registered" in logs
    assert row.audit.clean, row.audit.explain()
    assert (p.state, p.samples_done, p.shards_dead_lettered) == ("completed", p.samples_total, 0), p


def _post_ignoring_errors(api: httpx.Client, spec: dict) -> None:
    with contextlib.suppress(httpx.HTTPError):  # the producer is killed under this request
        api.post("/v1/jobs", json=spec)


def test_inference_server_that_hangs_is_abandoned_and_the_shard_completes(
    make_stack: MakeStack, chats: Path, fault_table
) -> None:
    """SIGSTOP the real server mid-request (TCP still accepts, nothing answers), every setting at its default: the
    workers abandon their requests once /health has been silent for EAGLE3_INFERENCE_HEALTH_TIMEOUT_S (60 s), not
    after the 300 s request timeout; their retries wait for the server; SIGCONT, and the job finishes by itself."""
    row = fault_table("inference server hangs (SIGSTOP) 90 s mid-request, default timeouts")
    with make_stack(workers=2) as stack:
        settings = stack.settings
        assert (settings.inference_timeout_s, settings.inference_health_timeout_s) == (
            DEFAULTS.inference_timeout_s,
            DEFAULTS.inference_health_timeout_s,
        )  # production behaviour, nothing shortened
        job_id = stack.submit(chats, shard_token_budget=SHARD_TOKENS)["job_id"]
        stack.lease_mid_shard(job_id)
        server = stack.process("inference")
        os.killpg(server.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            wait_for(lambda: "the server hangs" in stack.worker_logs(), 240, "a worker abandoning a hung request")
            detected_s = time.monotonic() - stopped_at
            time.sleep(max(90 - detected_s, 0))  # still hung: the retries wait for /health instead of failing
        finally:
            os.killpg(server.pid, signal.SIGCONT)
        resumed_at = time.monotonic()
        row.recover_s = wait_next_commit(stack, job_id) - resumed_at
        p = stack.wait(job_id, supervise=False)  # no resume: the job finishes by itself
        row.audit, row.reruns = audit_job(stack.storage, job_id), p.shards_rerun
        row.extra["hang_detected_s"] = detected_s
        row.note = (
            f"requests abandoned {detected_s:.0f}s after SIGSTOP (health timeout "
            f"{settings.inference_health_timeout_s:.0f}s, request timeout {settings.inference_timeout_s:.0f}s)"
        )
    # Silence counts from the last answer, up to one probe interval (5 s) before the SIGSTOP.
    assert settings.inference_health_timeout_s - 5 <= detected_s < settings.inference_timeout_s, detected_s
    assert row.audit.clean, row.audit.explain()
    assert (p.state, p.samples_done, p.shards_dead_lettered) == ("completed", p.samples_total, 0), p
