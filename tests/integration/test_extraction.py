"""extract_shard against a real reference server, real Redis and real storage (file and S3)."""

import hashlib
import threading
from pathlib import Path

import pytest
import redis

from shared.capture.client import InferenceClient
from shared.errors import ModelMismatch, ShardValidationError
from shared.lifecycle import jobs, progress, shards
from shared.lifecycle.kind import ShardContext
from shared.lifecycle.kinds import EXTRACT
from shared.lifecycle.schemas import JobSpec, Manifest
from shared.settings import Settings
from shared.storage import layout
from shared.storage.objects import Storage, open_storage
from tests.datasets import write_dataset
from tests.fixtures.faulty_inference import faulty_proxy


def plan(tmp_path: Path, model_dir: Path, redis_url: str, storage: Storage, **spec: object) -> jobs.JobRecord:
    dataset, _ = write_dataset(tmp_path / "data.jsonl", with_bad_lines=False)
    settings = Settings(
        redis_url=redis_url, storage_url=storage.url, dataset_roots=[str(tmp_path)], model_roots=[model_dir.parent]
    )
    return jobs.submit(
        JobSpec(dataset_url=str(dataset), model_path=str(model_dir), **spec),
        settings=settings,
        storage=storage,
        client=redis.Redis.from_url(redis_url),
        enqueue=lambda kind, job_id, shard: None,
    )


def extract(job_id: str, shard: int, storage: Storage, redis_url: str, url: str) -> shards.ShardOutcome:
    with InferenceClient(url, timeout_s=60, max_concurrency=2, transport="body", shm_dir=Path("/tmp")) as client:
        ctx = ShardContext(
            storage, redis.Redis.from_url(redis_url), Settings(), worker="test", states={"extract": client}
        )
        return shards.run_shard(EXTRACT, job_id, shard, ctx)


@pytest.fixture
def file_storage(tmp_path: Path) -> Storage:
    return open_storage((tmp_path / "store").as_uri())


def test_committed_shard_is_skipped_when_delivered_again(
    tmp_path: Path, tiny_model_dir: Path, redis_url: str, file_storage: Storage, reference_server_url: str
) -> None:
    job = plan(tmp_path, tiny_model_dir, redis_url, file_storage, shard_token_budget=100)
    first = extract(job.job_id, 0, file_storage, redis_url, reference_server_url)
    manifest_bytes = file_storage.get(layout.manifest(job.job_id, 0))
    second = extract(job.job_id, 0, file_storage, redis_url, reference_server_url)
    assert (first.status, second.status) == ("committed", "already_committed")
    assert file_storage.get(layout.manifest(job.job_id, 0)) == manifest_bytes
    assert progress.job_progress(redis.Redis.from_url(redis_url), job.job_id).tokens_done == first.num_tokens


def test_concurrent_duplicate_delivery_commits_one_identical_shard(
    tmp_path: Path,
    tiny_model_dir: Path,
    redis_url: str,
    s3_server,
    reference_server_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    storage = open_storage(
        s3_server.storage_url(f"dup-{tmp_path.name}"), Settings(s3_endpoint_url=s3_server.endpoint_url)
    )
    job = plan(tmp_path, tiny_model_dir, redis_url, storage, shard_token_budget=400)
    outcomes: list[shards.ShardOutcome] = []
    threads = [
        threading.Thread(
            target=lambda: outcomes.append(extract(job.job_id, 0, storage, redis_url, reference_server_url))
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(outcomes) == 2
    assert storage.list(layout.manifests_prefix(job.job_id)) == [layout.manifest(job.job_id, 0)]
    manifest = Manifest.model_validate_json(storage.get(layout.manifest(job.job_id, 0)))
    for s in manifest.samples:
        assert hashlib.sha256(storage.get(s.key)).hexdigest() == s.sha256
    p = progress.job_progress(redis.Redis.from_url(redis_url), job.job_id)
    assert (p.shards_committed, p.tokens_done) == (1, manifest.num_tokens)


@pytest.mark.parametrize(
    ("fault", "field", "reason"),
    [
        pytest.param("fewer_rows", "aux_hidden_state", "rows for a prompt of", id="fewer-rows"),
        pytest.param("nan", "hidden_state", "non-finite", id="nan"),
        pytest.param("wrong_hidden_size", "aux_hidden_state", "expected 192", id="wrong-hidden-size"),
    ],
)
def test_bad_capture_fails_the_shard_and_commits_nothing(
    fault: str,
    field: str,
    reason: str,
    tmp_path: Path,
    tiny_model_dir: Path,
    redis_url: str,
    file_storage: Storage,
    reference_server_url: str,
) -> None:
    job = plan(tmp_path, tiny_model_dir, redis_url, file_storage, shard_token_budget=100)
    with faulty_proxy(reference_server_url) as (url, state):
        state["fault"] = fault
        with pytest.raises(ShardValidationError) as info:
            extract(job.job_id, 0, file_storage, redis_url, url)
    assert info.value.field == field and reason in info.value.reason
    assert info.value.sample_id in str(info.value) and f"shard {0}" in str(info.value)
    assert not file_storage.list(f"{job.job_id}/rows_")
    assert not file_storage.exists(layout.manifest(job.job_id, 0))


def test_samples_written_before_a_crash_are_reused(
    tmp_path: Path, tiny_model_dir: Path, redis_url: str, file_storage: Storage, reference_server_url: str
) -> None:
    job = plan(tmp_path, tiny_model_dir, redis_url, file_storage, shard_token_budget=400)
    extract(job.job_id, 0, file_storage, redis_url, reference_server_url)
    manifest = Manifest.model_validate_json(file_storage.get(layout.manifest(job.job_id, 0)))
    # As if the worker died after writing all but the last sample, before the manifest.
    file_storage.delete(layout.manifest(job.job_id, 0))
    file_storage.delete(manifest.samples[-1].key)
    kept = {s.key: file_storage.get(s.key) for s in manifest.samples[:-1]}
    redis.Redis.from_url(redis_url).flushdb()
    progress.register_job(redis.Redis.from_url(redis_url), job, file_storage.url, EXTRACT)
    extract(job.job_id, 0, file_storage, redis_url, reference_server_url)
    again = Manifest.model_validate_json(file_storage.get(layout.manifest(job.job_id, 0)))
    assert [s.key for s in again.samples] == [s.key for s in manifest.samples]
    assert all(file_storage.get(key) == data for key, data in kept.items())
    assert again.samples[:-1] == manifest.samples[:-1]


def test_server_with_another_model_is_refused(
    tmp_path: Path, tiny_model_dir: Path, redis_url: str, file_storage: Storage, reference_server_url: str
) -> None:
    job = plan(tmp_path, tiny_model_dir, redis_url, file_storage)
    changed = job.model_copy(update={"hidden_size": 128})
    file_storage.put(layout.job_json(job.job_id), changed.model_dump_json().encode())
    with pytest.raises(ModelMismatch, match="hidden_size"):
        extract(job.job_id, 0, file_storage, redis_url, reference_server_url)
