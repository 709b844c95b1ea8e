"""Deleting jobs, retention, trimming and storage budgets, against a real Redis, a real SeaweedFS S3 (through the
fault proxy where storage must fail part way), real file storage, and the reference server for real shards."""

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from services.trainer.data import ShardFollower, TargetSignature
from shared.errors import JobDeleting, JobNotFound, OverBudget, OverStorageBudget, StorageUnavailable, SubmitError
from shared.lifecycle import budget, deletion, followers, jobs, progress, recovery
from shared.lifecycle.kind import read_shard_input
from shared.lifecycle.kinds import EXTRACT
from shared.lifecycle.schemas import Manifest
from shared.redis_replies import stream_entries
from shared.settings import Settings
from shared.storage import layout
from shared.storage.objects import Storage, open_storage
from tests.datasets import write_dataset
from tests.faults.fault_proxy import fault_proxy
from tests.fixtures.processes import wait_until
from tests.integration.test_extraction import extract, plan
from tests.integration.test_producer_api import Api, api_settings, make_api
from tests.integration.test_progress import make_job, make_manifest

DAY_S = 86400.0


def job_redis_keys(client: redis.Redis, job_id: str) -> set[bytes]:
    """Every Redis key that names the job, and every shared structure that holds it."""
    keys = {key for pattern in ("*:{}", "*:{}:*", "*|{}|*") for key in client.scan_iter(match=pattern.format(job_id))}
    if client.zscore(progress.JOBS_INDEX, job_id) is not None:
        keys.add(b"member of " + progress.JOBS_INDEX.encode())
    if any(m.startswith(f"{job_id}|".encode()) for m in client.hkeys(budget.RESERVED)):
        keys.add(b"reservation")
    return keys


def run_all(job: jobs.JobRecord, storage: Storage, redis_url: str, server: str) -> None:
    for shard in range(job.shards_total):
        assert extract(job.job_id, shard, storage, redis_url, server).status == "committed"


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


# ---------------------------------------------------------------------------------------------------------------------
# Delete


def test_delete_of_a_completed_job_removes_every_object_key_and_index_entry_and_nothing_of_another(
    tmp_path: Path,
    tiny_model_dir: Path,
    redis_url: str,
    client: redis.Redis,
    s3_storage_url: str,
    reference_server_url: str,
) -> None:
    storage = open_storage(s3_storage_url, Settings())  # Settings() reads the server the fixture set
    doomed = plan(tmp_path, tiny_model_dir, redis_url, storage, shard_token_budget=100, job_id="doomed")
    other = plan(tmp_path, tiny_model_dir, redis_url, storage, shard_token_budget=100, job_id="doomed-not")
    run_all(doomed, storage, redis_url, reference_server_url)
    run_all(other, storage, redis_url, reference_server_url)
    checkpoint = layout.trainer_checkpoint("doomed", "run-1", 10)
    storage.put(checkpoint, b"weights")
    other_objects = storage.list("doomed-not/")
    other_keys = job_redis_keys(client, "doomed-not")
    assert progress.job_progress(client, "doomed").state == "completed"
    assert len(storage.list("doomed/")) > 2 * doomed.shards_total and job_redis_keys(client, "doomed")

    report = deletion.delete_job("doomed", storage=storage, client=client)

    assert storage.list("doomed/") == [checkpoint]  # checkpoints stay unless asked
    assert report.objects_kept == 1 and report.objects_deleted > 2 * doomed.shards_total
    assert not storage.exists(layout.job_index_entry("doomed"))
    assert job_redis_keys(client, "doomed") == set()
    assert "doomed" not in progress.list_jobs(client)
    with pytest.raises(JobNotFound):
        progress.job_progress(client, "doomed")
    # Nothing of the other job (whose id starts with the deleted one's) went.
    assert storage.list("doomed-not/") == other_objects and storage.exists(layout.job_index_entry("doomed-not"))
    assert job_redis_keys(client, "doomed-not") == other_keys
    assert progress.job_progress(client, "doomed-not").state == "completed"

    deletion.delete_job("doomed", storage=storage, client=client, with_checkpoints=True)
    assert storage.list("doomed/") == []
    with pytest.raises(JobNotFound):
        deletion.delete_job("doomed", storage=storage, client=client)


def test_a_local_folder_delete_removes_the_files_and_their_folders(
    tmp_path: Path, tiny_model_dir: Path, redis_url: str, client: redis.Redis, reference_server_url: str
) -> None:
    storage = open_storage((tmp_path / "store").as_uri())
    job = plan(tmp_path, tiny_model_dir, redis_url, storage, shard_token_budget=100, job_id="local")
    run_all(job, storage, redis_url, reference_server_url)
    deletion.delete_job("local", storage=storage, client=client, with_checkpoints=True)
    assert not (tmp_path / "store" / "local").exists()
    assert not (tmp_path / "store" / layout.job_index_entry("local")).exists()
    assert (tmp_path / "store" / "_jobs").is_dir()  # the index's folder itself stays


@pytest.fixture
def api(redis_url: str, tmp_path: Path, tiny_model_dir: Path) -> Iterator[Api]:
    yield from make_api(api_settings(tmp_path, tiny_model_dir, redis_url=redis_url))


def submit(api: Api, tmp_path: Path, model: Path, job_id: str) -> dict:
    dataset, _ = write_dataset(tmp_path / "data.jsonl", with_bad_lines=False)
    response = api.client.post(
        "/v1/jobs", json={"dataset_url": str(dataset), "model_path": str(model), "job_id": job_id}
    )
    assert response.status_code == 201, response.text
    return response.json()["job"]


def test_delete_is_refused_for_a_running_job_and_a_followed_one_and_needs_the_token(
    api: Api, tmp_path: Path, tiny_model_dir: Path, client: redis.Redis
) -> None:
    submit(api, tmp_path, tiny_model_dir, "busy")
    assert api.client.delete("/v1/jobs/busy", headers={"Authorization": ""}).status_code == 401
    refused = api.client.delete("/v1/jobs/busy")
    assert refused.status_code == 409
    assert (
        refused.json()["detail"]
        == "job busy is queued: cancel it first (`eagle3 cancel busy`), or delete with --cancel"
    )
    assert api.client.get("/v1/jobs/busy/progress").json()["state"] == "queued"  # untouched

    api.client.post("/v1/jobs/busy/cancel")
    mark = followers.FollowerMark(client, "busy")
    try:
        refused = api.client.delete("/v1/jobs/busy")
        assert refused.status_code == 409
        assert refused.json()["detail"].startswith(f"job busy is followed by a running trainer ({mark.name})")
        assert api.client.get("/v1/jobs/busy/progress").json()["state"] == "cancelled"
        forced = api.client.delete("/v1/jobs/busy", params={"force": "true"})
        assert forced.status_code == 200, forced.text
    finally:
        mark.stop()
    assert api.client.get("/v1/jobs/busy/progress").status_code == 404

    submit(api, tmp_path, tiny_model_dir, "busy-2")
    report = api.client.delete("/v1/jobs/busy-2", params={"cancel": "true"}).json()
    assert report["cancelled"] and report["objects_deleted"] > 0
    assert api.client.get("/v1/jobs").json() == []


def test_a_delete_interrupted_by_s3_shows_deleting_and_finishes_when_run_again(
    tmp_path: Path,
    tiny_model_dir: Path,
    redis_url: str,
    client: redis.Redis,
    s3_server,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    direct = open_storage(s3_server.storage_url("interrupted"), Settings(s3_endpoint_url=s3_server.endpoint_url))
    plan(tmp_path, tiny_model_dir, redis_url, direct, job_id="big")
    jobs.cancel("big", storage=direct, client=client)
    with ThreadPoolExecutor(16) as pool:  # more than one DeleteObjects request's worth
        list(pool.map(lambda i: direct.put(layout.sample("big", i), b"x" * 64), range(1500)))
    before = len(direct.list("big/"))

    with fault_proxy(s3_server.endpoint_url) as proxy:
        through = open_storage(s3_server.storage_url("interrupted"), Settings(s3_endpoint_url=proxy.endpoint_url))
        deletes = []

        def fail_after_the_first_batch(head: bytes) -> None:
            if head.startswith(b"POST") and b"?delete" in head.split(b"\r\n", 1)[0]:
                deletes.append(head)
                if len(deletes) > 1:
                    proxy.fault = "slowdown"  # S3 answers 503 from here on

        proxy.on_request = fail_after_the_first_batch
        with pytest.raises(StorageUnavailable):
            deletion.delete_job("big", storage=through, client=client)

    # Half deleted, and visibly so: deleting in Redis (status, jobs, API) and in storage's index.
    left = direct.list("big/")
    assert before - len(left) == deletion.DELETE_BATCH and layout.job_json("big") in left
    assert progress.job_progress(client, "big").state == "deleting"
    assert recovery.deleting_detail(direct, "big") is not None
    with pytest.raises(JobDeleting):
        jobs.resume("big", storage=direct, client=client, enqueue=lambda *a: None)
    with pytest.raises(SubmitError, match="already exists"):  # nor may a submit of the same id plan over it
        plan(tmp_path, tiny_model_dir, redis_url, direct, job_id="big")

    # Redis lost meanwhile: recovery brings the job back as deleting, and enqueues nothing.
    client.flushdb()
    enqueued: list[int] = []
    recovery.recover_jobs(direct, client, enqueue=lambda kind, job_id, shard: enqueued.append(shard))
    assert enqueued == [] and progress.job_progress(client, "big").state == "deleting"

    report = deletion.delete_job("big", storage=direct, client=client)
    assert report.finished_earlier_delete and report.objects_deleted == len(left)
    assert direct.list("big/") == [] and not direct.exists(layout.job_index_entry("big"))
    assert job_redis_keys(client, "big") == set()


# ---------------------------------------------------------------------------------------------------------------------
# Retention and trimming


def age(client: redis.Redis, job_id: str, days: float) -> None:
    """Move a job's creation (and so its end, for a job that never committed) back by `days`."""
    key = progress.job_key(job_id)
    client.hset(key, "created_ts", float(client.hget(key, "created_ts") or 0) - days * DAY_S)


def test_retention_deletes_only_finished_jobs_past_the_age(
    tmp_path: Path, tiny_model_dir: Path, redis_url: str, client: redis.Redis
) -> None:
    storage = open_storage((tmp_path / "store").as_uri())
    for job_id in ("old-cancelled", "old-running", "new-cancelled", "old-followed"):
        plan(tmp_path, tiny_model_dir, redis_url, storage, job_id=job_id)
    for job_id in ("old-cancelled", "new-cancelled", "old-followed"):
        jobs.cancel(job_id, storage=storage, client=client)
    for job_id in ("old-cancelled", "old-running", "old-followed"):
        age(client, job_id, 8)
    age(client, "new-cancelled", 6)

    expired = deletion.expired_jobs(client, 7 * DAY_S)
    assert sorted(p.job_id for p in expired) == ["old-cancelled", "old-followed"]
    mark = followers.FollowerMark(client, "old-followed")
    try:
        settings = Settings(redis_url=redis_url, storage_url=storage.url, retention_days=7)
        reports = deletion.maintain(storage, client, settings)
    finally:
        mark.stop()
    assert [r.job_id for r in reports] == ["old-cancelled"]
    assert sorted(progress.list_jobs(client)) == ["new-cancelled", "old-followed", "old-running"]
    assert storage.list("old-cancelled/") == [] and storage.exists(layout.job_json("old-running"))
    assert deletion.maintain(storage, client, settings.model_copy(update={"retention_days": None})) == []


def test_the_producer_applies_the_retention_on_its_schedule(
    redis_url: str, tmp_path: Path, tiny_model_dir: Path, client: redis.Redis
) -> None:
    settings = api_settings(tmp_path, tiny_model_dir, redis_url=redis_url)
    storage = open_storage(settings.storage_url)
    plan(tmp_path, tiny_model_dir, redis_url, storage, job_id="expired")
    jobs.cancel("expired", storage=storage, client=client)
    age(client, "expired", 3)
    for api in make_api(settings.model_copy(update={"retention_days": 2.0})):
        wait_until(lambda: not client.exists(progress.job_key("expired")), timeout_s=30)
        assert api.client.get("/v1/jobs").json() == []
    assert storage.list("expired/") == []


def test_finished_jobs_events_are_trimmed_unless_a_trainer_follows(client: redis.Redis) -> None:
    shards = deletion.FINISHED_EVENTS_KEPT + 50
    progress.register_job(client, make_job(shards=shards), "file:///tmp/x", EXTRACT)
    for shard in range(shards - 1):
        progress.record_commit(client, make_manifest(shard))
    assert deletion.trim_finished_events(client) == []  # running
    progress.record_commit(client, make_manifest(shards - 1))
    mark = followers.FollowerMark(client, "job-a")
    assert deletion.trim_finished_events(client) == []  # followed
    mark.stop()
    assert deletion.trim_finished_events(client) == ["job-a"]
    events = stream_entries(client.xrange(progress.events_key("job-a")))
    assert len(events) == deletion.FINISHED_EVENTS_KEPT
    assert int(events[-1][1][b"shard_index"]) == shards - 1  # the newest stay
    p = progress.job_progress(client, "job-a")
    assert p.state == "completed" and p.tokens_done == p.tokens_total


# ---------------------------------------------------------------------------------------------------------------------
# Budgets


def test_a_shard_that_would_cross_a_budget_writes_nothing_and_goes_on_once_it_fits(
    tmp_path: Path, tiny_model_dir: Path, redis_url: str, client: redis.Redis, reference_server_url: str
) -> None:
    storage = open_storage((tmp_path / "store").as_uri())
    job = plan(tmp_path, tiny_model_dir, redis_url, storage, shard_token_budget=100, job_id="budgeted")
    assert job.shards_total >= 4
    first = extract("budgeted", 0, storage, redis_url, reference_server_url)
    budget.set_job_budget(client, "budgeted", first.bytes + 10)  # nothing more fits
    with pytest.raises(OverStorageBudget) as refused:
        extract("budgeted", 1, storage, redis_url, reference_server_url)
    assert str(refused.value).startswith("job budgeted shard 1 needs about ")
    assert "over the job budget of " in str(refused.value)
    assert not storage.exists(layout.manifest("budgeted", 1))
    shard_one = [s.sample_index for s in read_shard_input(EXTRACT, storage, "budgeted", 1).samples]
    assert not any(storage.exists(layout.sample("budgeted", i)) for i in shard_one)
    assert client.hlen(budget.RESERVED) == 0  # a refused shard holds no reservation

    # The store-wide budget counts every job's stored bytes: another job's count fills it.
    budget.set_job_budget(client, "budgeted", None)
    budget.set_store_budget(client, first.bytes + 10)
    with pytest.raises(OverStorageBudget, match="over the storage budget"):
        extract("budgeted", 1, storage, redis_url, reference_server_url)
    budget.set_store_budget(client, None)
    assert extract("budgeted", 1, storage, redis_url, reference_server_url).status == "committed"


def test_submit_counts_what_is_stored_already(
    tmp_path: Path, tiny_model_dir: Path, redis_url: str, client: redis.Redis, reference_server_url: str
) -> None:
    storage = open_storage((tmp_path / "store").as_uri())
    first = plan(tmp_path, tiny_model_dir, redis_url, storage, job_id="first")
    run_all(first, storage, redis_url, reference_server_url)
    stored = budget.stored_bytes(client)
    assert stored == progress.job_progress(client, "first").bytes_stored > 0
    budget.set_store_budget(client, stored + first.projected_bytes // 2)
    with pytest.raises(OverBudget, match=r"GB is stored already"):
        plan(tmp_path, tiny_model_dir, redis_url, storage, job_id="second")
    deletion.delete_job("first", storage=storage, client=client)
    assert plan(tmp_path, tiny_model_dir, redis_url, storage, job_id="second").job_id == "second"


def test_concurrent_shards_never_reserve_past_the_budget(client: redis.Redis) -> None:
    job = make_job(shards=40)
    progress.register_job(client, job, "file:///tmp/x", EXTRACT)
    settings = Settings(storage_budget_bytes=10 * 1000)
    granted: list[int] = []
    lock = threading.Lock()

    def attempt(shard: int) -> None:
        try:
            budget.reserve(client, settings, job, shard, 1000)
        except OverStorageBudget:
            return
        with lock:
            granted.append(shard)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(attempt, range(40)))
    assert len(granted) == 10
    manifest: Manifest = make_manifest(granted[0], nbytes=1000)
    progress.record_commit(client, manifest)
    budget.release(client, job.job_id, granted[0])
    with pytest.raises(OverStorageBudget):  # its bytes are stored now instead of reserved
        budget.reserve(client, settings, job, 39, 1000)


def test_a_following_trainer_marks_the_job_until_it_stops(tmp_path: Path, client: redis.Redis) -> None:
    storage = open_storage((tmp_path / "store").as_uri())
    job = make_job()
    expected = TargetSignature((1, 3, 4), 64, 8, "LlamaForCausalLM")
    reading = ShardFollower(job, storage=storage, expected=expected)  # a trainer that does not follow: no mark
    assert reading.mark is None and followers.live_followers(client, job.job_id) == []
    follower = ShardFollower(job, storage=storage, expected=expected, redis_client=client, follow=True)
    assert follower.mark is not None
    assert followers.live_followers(client, job.job_id) == [follower.mark.name]
    assert 0 < client.ttl(followers.followers_key(job.job_id)) <= followers.FOLLOWER_TTL_S  # lapses by itself
    follower.mark.stop()
    assert followers.live_followers(client, job.job_id) == []
