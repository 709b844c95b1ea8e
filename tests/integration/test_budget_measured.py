"""The storage budget counts everything stored: the jobs' committed samples as each commit counts them, and the rest
of the store (job files, inputs, manifests, trainer checkpoints, anything else) as the producer measures it, on a
real Redis and on both a local store and a real S3 server (SeaweedFS)."""

from pathlib import Path

import pytest
import redis

from shared.errors import OverStorageBudget
from shared.lifecycle import budget, progress
from shared.lifecycle.kinds import EXTRACT
from shared.settings import Settings
from shared.storage.objects import RESERVED_PREFIX, open_storage
from tests.integration.test_progress import make_job, make_manifest


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


def test_a_checkpoint_counts_once_measured_and_makes_a_shard_wait_until_it_goes(
    tmp_path: Path, client: redis.Redis
) -> None:
    storage = open_storage((tmp_path / "store").as_uri())
    job = make_job(shards=4)
    progress.register_job(client, job, storage.url, EXTRACT)
    storage.put(f"{job.job_id}/data_0.pt", b"s" * 1000)  # a committed sample: counted by its manifest
    progress.record_commit(client, make_manifest(0, nbytes=1000))
    storage.put(f"{job.job_id}/job.json", b"j" * 200)
    assert budget.stored_bytes(client) == 1000  # nothing measured yet: the samples alone

    checkpoint = f"{job.job_id}/trainer/run-1/step_000100.pt"
    storage.put(checkpoint, b"c" * 5000)
    assert budget.measure_other_bytes(client, storage) == 5200  # the job's file and the checkpoint
    assert budget.stored_bytes(client) == 6200

    settings = Settings(storage_budget_bytes=7000)
    with pytest.raises(OverStorageBudget, match=r"stored in all"):
        budget.reserve(client, settings, job, 1, 1000)  # 6,200 + 1,000 > 7,000: the checkpoint keeps it out
    storage.delete(checkpoint)
    assert budget.measure_other_bytes(client, storage) == 200
    assert budget.reserve(client, settings, job, 1, 1000)  # 1,200 + 1,000 fits now


def test_the_store_measures_its_bytes_without_writes_in_progress(tmp_path: Path, s3_storage_url: str) -> None:
    s3 = open_storage(s3_storage_url, Settings())  # the S3 server the fixture named in the environment
    for storage in (open_storage((tmp_path / "store").as_uri()), s3):
        assert storage.total_size() == 0
        storage.put("job-a/job.json", b"x" * 123)
        storage.put("job-a/rows_0-2000/data_0.pt", b"y" * 4567)
        storage.put("job-b/trainer/run/latest.json", b"z" * 10)
        assert storage.total_size() == 123 + 4567 + 10, storage.url
        if storage.url.startswith("file://"):  # a write's temporary file is no object yet
            (tmp_path / "store" / "job-a" / f"{RESERVED_PREFIX}tmp").write_bytes(b"t" * 999)
            assert storage.total_size() == 123 + 4567 + 10


def test_the_kept_total_follows_commits_and_a_recount_sets_it_right(client: redis.Redis) -> None:
    """The budget reads one kept total, not every job's hash: each commit adds to it (a repeated commit does not), a
    recount sums the hashes again (a rebuild, a delete and the producer's upkeep recount), and a Redis without the
    total (a new one, or one from before it was kept) gets it recounted at its first read."""
    job = make_job(shards=4)
    progress.register_job(client, job, "file:///tmp/x", EXTRACT)
    for shard in (0, 1, 1):  # shard 1 committed twice, counted once
        progress.record_commit(client, make_manifest(shard, nbytes=1000))
    assert progress.bytes_stored_total(client) == 2000 == budget.samples_bytes(client)
    client.set(progress.BYTES_STORED_TOTAL, 12345)  # drifted, by whatever means
    assert progress.recount_bytes_stored(client) == 2000
    client.delete(progress.BYTES_STORED_TOTAL)
    assert progress.bytes_stored_total(client) == 2000 and client.get(progress.BYTES_STORED_TOTAL) == b"2000"
    settings = Settings(storage_budget_bytes=2500)
    with pytest.raises(OverStorageBudget):
        budget.reserve(client, settings, job, 2, 1000)  # 2,000 + 1,000 > 2,500, from the total alone
    assert budget.reserve(client, settings, job, 2, 500)
    client.delete(progress.BYTES_STORED_TOTAL)  # a reservation on a Redis without the total recounts it first
    with pytest.raises(OverStorageBudget):
        budget.reserve(client, settings, job, 3, 1000)
    assert client.get(progress.BYTES_STORED_TOTAL) == b"2000"
