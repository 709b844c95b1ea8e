"""Storage faults while a job runs on real processes: through a fault-injecting TCP proxy in front of SeaweedFS
(refused, reset, 503, slow, unreachable, full), and the SeaweedFS process itself stopped and started again. Every
job must finish by itself: no resume, no dead letter."""

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.errors import StorageUnavailable
from shared.lifecycle.schemas import DeadLetter, Progress
from shared.storage import layout
from tests.faults.audit import audit_job
from tests.faults.conftest import MakeStack, own_weed_env
from tests.faults.fault_proxy import Fault, FaultProxy, fault_proxy
from tests.faults.stack import FaultStack, wait_for
from tests.fixtures.seaweedfs import WeedMini

pytestmark = [pytest.mark.faults, pytest.mark.slow]

SHARD_TOKENS = 1500


@pytest.fixture
def proxy(s3_server) -> Iterator[FaultProxy]:
    with fault_proxy(s3_server.endpoint_url) as proxy:
        yield proxy


def finish(stack: FaultStack, job_id: str) -> tuple[Progress, list[DeadLetter]]:
    """Wait for the job (no resume: it must finish by itself) and read its dead letters."""
    p = stack.wait(job_id, supervise=False)
    letters = [
        DeadLetter.model_validate_json(stack.storage.get(k))
        for k in stack.storage.list(layout.dead_letter_prefix(job_id))
    ]
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
        p, letters = finish(stack, job_id)
        row.recover_s = time.monotonic() - started
        row.audit, row.reruns = audit_job(stack.storage, job_id), p.shards_rerun
        row.note = f"{proxy.injected} requests faulted; {len(letters)} shard(s) dead-lettered"
    assert proxy.injected > 0
    assert row.audit.clean, row.audit.explain()
    assert (p.state, p.samples_done, letters) == ("completed", p.samples_total, []), p


def test_s3_unreachable_for_30_seconds(make_stack: MakeStack, chats: Path, proxy: FaultProxy, fault_table) -> None:
    row = fault_table("S3 unreachable 30 s (proxy refuses connections)")
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
        p, letters = finish(stack, job_id)
        row.audit, row.reruns = audit_job(stack.storage, job_id), p.shards_rerun
    assert row.audit.clean, row.audit.explain()
    assert (p.state, p.samples_done, letters) == ("completed", p.samples_total, []), p


def test_seaweedfs_stopped_for_30_seconds(
    make_stack: MakeStack, chats: Path, own_weed: WeedMini, tmp_path: Path, fault_table
) -> None:
    """The real SeaweedFS process stopped (SIGTERM) mid-job and started again 30 s later on the same data directory
    and ports, as a maintenance restart does."""
    row = fault_table("SeaweedFS process stopped 30 s, restarted on its data")
    with make_stack(workers=2, s3=own_weed.server) as stack:
        job_id = stack.submit(chats, shard_token_budget=SHARD_TOKENS)["job_id"]
        stack.lease_mid_shard(job_id)
        own_weed.terminate()
        stopped_at = time.monotonic()
        with pytest.raises(StorageUnavailable):
            stack.storage.list(f"{job_id}/")  # really gone
        time.sleep(max(30 - (time.monotonic() - stopped_at), 0))
        own_weed.start(own_weed_env(tmp_path), tmp_path / "weed-restarted.log")
        back = time.monotonic()
        before = stack.committed(job_id)
        wait_for(lambda: stack.committed(job_id) - before, 300, "a shard committed after the restart")
        row.recover_s = time.monotonic() - back
        p, letters = finish(stack, job_id)
        row.audit, row.reruns = audit_job(stack.storage, job_id), p.shards_rerun
        row.note = f"down {back - stopped_at:.0f}s (stop, 30 s, start until the bucket takes writes)"
    assert row.audit.clean, row.audit.explain()
    assert (p.state, p.samples_done, letters) == ("completed", p.samples_total, []), p


def test_storage_full_mid_job_pauses_then_resumes_by_itself(
    make_stack: MakeStack, chats: Path, proxy: FaultProxy, fault_table
) -> None:
    row = fault_table("storage full (507 on writes) 40 s mid-job, paused with reason")
    with make_stack(workers=2, s3_endpoint_url=proxy.endpoint_url) as stack:
        job_id = stack.submit(chats, shard_token_budget=SHARD_TOKENS)["job_id"]
        stack.lease_mid_shard(job_id)
        proxy.fault = "full"
        full_at = time.monotonic()
        wait_for(lambda: proxy.injected >= 2, 120, "writes refused as storage full")
        wait_for(lambda: stack.progress(job_id).state == "paused", 60, "the job paused")
        # The state and its reason, wherever progress is shown: the API, `eagle3 status`, the dashboard's data.
        shown = stack.api.get(f"/v1/jobs/{job_id}/progress").json()
        assert shown["state"] == "paused" and shown["paused_reason"].startswith("storage full: "), shown
        assert "InsufficientStorage" in shown["paused_reason"], shown
        status = subprocess.run(
            [sys.executable, "-m", "eagle3", "status", job_id],
            env={**stack.stack.env, "COLUMNS": "200"},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        assert f"job {job_id}: paused" in status, status
        assert any("paused" in line and "storage full: " in line for line in status.splitlines()), status
        (overview,) = [j for j in stack.api.get("/v1/overview").json()["jobs"] if j["progress"]["job_id"] == job_id]
        # (Each refused write records its own key in the reason, so compare what does not change.)
        assert overview["progress"]["state"] == "paused", overview
        assert overview["progress"]["paused_reason"].startswith("storage full: "), overview
        time.sleep(max(40 - (time.monotonic() - full_at), 0))
        # Nothing partial: no torn file, and no sample file outside a manifest (a failed shard deletes its own).
        partial = audit_job(stack.storage, job_id)
        assert not partial.torn and not partial.stray, partial.explain()
        proxy.fault = "none"
        room_again = time.monotonic()
        p, letters = finish(stack, job_id)
        row.recover_s = time.monotonic() - room_again
        row.audit, row.reruns = audit_job(stack.storage, job_id), p.shards_rerun
        row.note = f"{proxy.injected} writes refused; paused: {shown['paused_reason'][:70]}..."
    assert row.audit.clean, row.audit.explain()
    assert (p.state, p.samples_done, p.paused_reason, letters) == ("completed", p.samples_total, None, []), p
