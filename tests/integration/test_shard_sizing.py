"""Shards sized in seconds (`shard_seconds`): the last extraction shards' measured rate, kept in a real Redis,
turns seconds into a token budget at submit; without a measurement the budget given stands."""

from pathlib import Path

import pytest
import redis

from shared.lifecycle import jobs, shard_metrics
from shared.lifecycle.jobs import MAX_SIZED_SHARD_TOKENS, MIN_SIZED_SHARD_TOKENS, sized_shards
from shared.lifecycle.schemas import JobSpec
from shared.settings import Settings
from shared.storage.objects import open_storage
from tests.datasets import write_dataset


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


def record(client: redis.Redis, tokens: int, seconds: float, *, task: str = "extract") -> None:
    shard_metrics.record_shard(client, task=task, seconds=seconds, bytes_written=tokens * 10, tokens=tokens)


def test_the_rate_is_over_the_last_shards_of_the_kind(client: redis.Redis) -> None:
    assert shard_metrics.recent_rate(client, "extract") is None
    record(client, 1000, 10.0)  # 100 tokens/s: pushed out by the newer shards below
    for _ in range(shard_metrics.RECENT_SHARDS):
        record(client, 4000, 2.0)  # 2,000 tokens/s
    record(client, 50, 1.0, task="regenerate")  # decoding says nothing about capture
    assert shard_metrics.recent_rate(client, "extract") == pytest.approx(2000.0)
    assert shard_metrics.recent_rate(client, "regenerate") == pytest.approx(50.0)


def test_seconds_become_tokens_at_the_measured_rate_within_bounds(client: redis.Redis) -> None:
    spec = JobSpec(dataset_url="d.jsonl", shard_token_budget=16384, shard_seconds=5.0)
    assert sized_shards(spec, client).shard_token_budget == 16384  # nothing measured yet
    record(client, 30_000, 2.0)  # 15,000 tokens/s per worker
    assert sized_shards(spec, client).shard_token_budget == 75_000
    assert sized_shards(spec.model_copy(update={"shard_seconds": 0.01}), client).shard_token_budget == (
        MIN_SIZED_SHARD_TOKENS
    )
    assert sized_shards(spec.model_copy(update={"shard_seconds": 1e6}), client).shard_token_budget == (
        MAX_SIZED_SHARD_TOKENS
    )
    assert sized_shards(JobSpec(dataset_url="d.jsonl"), client).shard_token_budget == 16384  # not asked
    regenerate = JobSpec(dataset_url="d.jsonl", kind="regenerate", shard_seconds=5.0)
    assert sized_shards(regenerate, client) == regenerate  # its chained extraction job is sized at its own submit


def test_a_submitted_job_is_planned_and_recorded_with_the_sized_budget(
    tmp_path: Path, tiny_model_dir: Path, redis_url: str, client: redis.Redis
) -> None:
    dataset, _ = write_dataset(tmp_path / "data.jsonl", with_bad_lines=False, repeat=8)
    storage = open_storage((tmp_path / "store").as_uri())
    settings = Settings(
        redis_url=redis_url, storage_url=storage.url, dataset_roots=[str(tmp_path)], model_roots=[tiny_model_dir.parent]
    )
    record(client, 1250, 1.0)  # 1,250 tokens/s: 2 s make 2,500-token shards

    job = jobs.submit(
        JobSpec(dataset_url=str(dataset), model_path=str(tiny_model_dir), shard_seconds=2.0),
        settings=settings,
        storage=storage,
        client=client,
        enqueue=lambda kind, job_id, shard: None,
    )

    assert job.spec.shard_token_budget == 2500 and job.spec.shard_seconds == 2.0
    assert '"shard_token_budget": 2500' in storage.get(f"{job.job_id}/job.json").decode()
    assert job.tokens_total > 2 * 2500 and job.shards_total == pytest.approx(job.tokens_total / 2500, abs=1)
