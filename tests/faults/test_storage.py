"""S3 faults through a fault-injecting TCP proxy in front of SeaweedFS, while a job runs on real processes."""

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared import layout
from shared.schemas import DeadLetter, Progress
from tests.faults.audit import audit_job
from tests.faults.conftest import MakeStack
from tests.faults.fault_proxy import Fault, FaultProxy, fault_proxy
from tests.faults.stack import FaultStack, wait_for

pytestmark = [pytest.mark.faults, pytest.mark.slow]

SHARD_TOKENS = 1500


@pytest.fixture
def proxy(s3_server) -> Iterator[FaultProxy]:
    with fault_proxy(s3_server.endpoint_url) as proxy:
        yield proxy


def finish_resuming(stack: FaultStack, job_id: str) -> tuple[Progress, list[DeadLetter]]:
    """Wait for the job; if shards were dead-lettered, read why, resume, wait again."""
    p = stack.wait(job_id, supervise=False)
    letters = [
        DeadLetter.model_validate_json(stack.storage.get(k))
        for k in stack.storage.list(layout.dead_letter_prefix(job_id))
    ]
    if p.state == "completed_with_errors":
        assert stack.api.post(f"/v1/jobs/{job_id}/resume").status_code == 200
        p = stack.wait(job_id, supervise=False)
    return p, letters


def test_s3_refused_reset_slowdown_and_slow(make_stack: MakeStack, chats: Path, proxy: FaultProxy, fault_table) -> None:
    row = fault_table("S3 refused / reset mid-upload / 503 SlowDown / slow (6 s each)")
    with make_stack(workers=2, s3_endpoint_url=proxy.endpoint_url) as stack:
        job_id = stack.submit(chats, shard_token_budget=SHARD_TOKENS)["job_id"]
        stack.lease_mid_shard(job_id)
        started = time.monotonic()
        faults: list[Fault] = ["reset", "slowdown", "refuse", "slow"]
        for fault in faults:
            if fault == "refuse":
                proxy.listen(False)
            else:
                proxy.fault = fault
            time.sleep(6)
            proxy.listen(True)
            proxy.fault = "none"
        p, letters = finish_resuming(stack, job_id)
        row.recover_s = time.monotonic() - started
        row.audit, row.reruns = audit_job(stack.storage, job_id), p.shards_rerun
        row.note = f"{proxy.injected} requests faulted; {len(letters)} shard(s) dead-lettered then resumed"
    assert proxy.injected > 0
    assert row.audit.clean, row.audit.explain()
    assert (p.state, p.samples_done) == ("completed", p.samples_total), p


def test_s3_unreachable_for_30_seconds(make_stack: MakeStack, chats: Path, proxy: FaultProxy, fault_table) -> None:
    row = fault_table("S3 unreachable 30 s (connections refused)")
    with make_stack(workers=2, s3_endpoint_url=proxy.endpoint_url) as stack:
        job_id = stack.submit(chats, shard_token_budget=SHARD_TOKENS)["job_id"]
        stack.lease_mid_shard(job_id)
        proxy.listen(False)
        time.sleep(30)
        proxy.listen(True)
        back = time.monotonic()
        before = stack.committed(job_id)
        wait_for(lambda: stack.committed(job_id) - before, 300, "a shard committed after the outage")
        row.recover_s = time.monotonic() - back
        p, letters = finish_resuming(stack, job_id)
        row.audit, row.reruns = audit_job(stack.storage, job_id), p.shards_rerun
        row.note = f"{len(letters)} shard(s) dead-lettered" + (
            f" ({letters[0].reason[:60]}), resumed" if letters else ""
        )
    assert row.audit.clean, row.audit.explain()
    assert (p.state, p.samples_done) == ("completed", p.samples_total), p


def test_storage_full_mid_job_pauses_then_resumes(
    make_stack: MakeStack, chats: Path, proxy: FaultProxy, fault_table
) -> None:
    row = fault_table("storage full (507 on writes) 40 s mid-job")
    with make_stack(workers=2, s3_endpoint_url=proxy.endpoint_url) as stack:
        job_id = stack.submit(chats, shard_token_budget=SHARD_TOKENS)["job_id"]
        stack.lease_mid_shard(job_id)
        proxy.fault = "full"
        wait_for(lambda: proxy.injected >= 2, 120, "writes refused as storage full")
        time.sleep(40)  # the fault's duration: shards fail, retry, and cannot even write their dead letters
        partial = audit_job(stack.storage, job_id)
        # Nothing partial: no torn file, and no sample file outside a manifest (a failed shard deletes its own).
        assert not partial.torn and not partial.stray, partial.explain()
        proxy.fault = "none"
        room_again = time.monotonic()
        p, letters = finish_resuming(stack, job_id)
        row.recover_s = time.monotonic() - room_again
        row.audit, row.reruns = audit_job(stack.storage, job_id), p.shards_rerun
        row.note = f"{proxy.injected} writes refused; {len(letters)} shard(s) dead-lettered"
    assert row.audit.clean, row.audit.explain()
    assert (p.state, p.samples_done) == ("completed", p.samples_total), p
