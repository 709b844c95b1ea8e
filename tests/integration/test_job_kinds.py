"""What the shared lifecycle gives every job kind alike, against real Redis and file storage: the same checks at
submit, the same dead letter, the same resume."""

from pathlib import Path

import pytest
import redis

from shared.errors import InferenceUnavailable, SubmitError
from shared.lifecycle import jobs, progress, shards
from shared.lifecycle.kind import ShardContext
from shared.lifecycle.kinds import KINDS, kind_of
from shared.lifecycle.schemas import DeadLetter, JobSpec
from shared.settings import Settings
from shared.storage import layout
from shared.storage.objects import Storage, open_storage
from tests.datasets import write_dataset
from tests.integration.test_progress import make_job

# The kinds that plan from a dataset; an audit plans from another job's committed samples (test_audit.py).
DATASET_KINDS = sorted(name for name, kind in KINDS.items() if kind.reads_dataset)


@pytest.fixture
def storage(tmp_path: Path) -> Storage:
    return open_storage((tmp_path / "store").as_uri())


def submit(tmp_path: Path, model_dir: Path, redis_url: str, storage: Storage, sent: list, **spec: object):
    dataset, _ = write_dataset(tmp_path / "data.jsonl", with_bad_lines=False)
    return jobs.submit(
        JobSpec(dataset_url=str(dataset), model_path=str(model_dir), **spec),
        settings=Settings(
            redis_url=redis_url, storage_url=storage.url, dataset_roots=[str(tmp_path)], model_roots=[model_dir.parent]
        ),
        storage=storage,
        client=redis.Redis.from_url(redis_url),
        enqueue=lambda kind, job_id, shard: sent.append((kind, job_id, shard)),
    )


@pytest.mark.parametrize("kind", DATASET_KINDS)
def test_every_kind_refuses_bad_layer_ids_before_anything_is_stored(
    kind: str, tmp_path: Path, tiny_model_dir: Path, redis_url: str, storage: Storage
) -> None:
    sent: list = []
    with pytest.raises(SubmitError, match=r"aux_layer_ids \[1, 3, 99\]: must be increasing ids in \[0, 8\)"):
        submit(tmp_path, tiny_model_dir, redis_url, storage, sent, kind=kind, aux_layer_ids=[1, 3, 99])
    assert sent == [] and storage.list("") == []


@pytest.mark.parametrize("kind", DATASET_KINDS)
def test_every_kind_plans_enqueues_and_resumes_through_one_frame(
    kind: str, tmp_path: Path, tiny_model_dir: Path, redis_url: str, storage: Storage
) -> None:
    sent: list = []
    # Small shards, each kind by its own option (an option of another kind is refused).
    small_shards = {"extract": {"shard_token_budget": 100}, "regenerate": {"conversations_per_shard": 2}}[kind]
    job = submit(tmp_path, tiny_model_dir, redis_url, storage, sent, kind=kind, **small_shards)
    assert job.kind == kind and job.shards_total > 1
    assert sent == [(kind, job.job_id, k) for k in range(job.shards_total)]
    for k in range(job.shards_total):
        shard = jobs.load_shard_input(storage, job, k)
        assert isinstance(shard, kind_of(kind).input_type) and shard.shard_index == k
    sent.clear()
    assert jobs.resume(
        job.job_id, storage=storage, client=redis.Redis.from_url(redis_url), enqueue=lambda *a: sent.append(a)
    ) == list(range(job.shards_total))
    assert [k for _, _, k in sent] == list(range(job.shards_total))


def test_a_shard_without_its_input_is_still_dead_lettered(
    tmp_path: Path, tiny_model_dir: Path, redis_url: str, storage: Storage
) -> None:
    job = submit(tmp_path, tiny_model_dir, redis_url, storage, [])
    storage.delete(layout.shard_input(job.job_id, 0))
    ctx = ShardContext(storage, redis.Redis.from_url(redis_url), Settings(), worker="test")
    error = InferenceUnavailable("http://inference/generate: ConnectError")

    letter = shards.dead_letter(kind_of("extract"), job.job_id, 0, error, retries=8, ctx=ctx)

    stored = DeadLetter.model_validate_json(storage.get(layout.dead_letter(job.job_id, 0)))
    assert letter == stored and (stored.error_type, stored.retries) == ("InferenceUnavailable", 8)
    assert progress.job_progress(ctx.redis, job.job_id).shards_dead_lettered == 1


def test_an_unknown_kind_is_refused_by_name() -> None:
    with pytest.raises(SubmitError, match="job kind 'evaluate': not one of"):
        kind_of("evaluate")


def test_a_drafter_trains_on_an_extraction_job_itself(storage: Storage) -> None:
    """The trainer asks the job's kind which job to train on (a regenerate job names its chained extraction job:
    tests/integration/test_regeneration.py)."""
    job = make_job()
    assert kind_of(job.kind).training_job(storage, job) == job.job_id
