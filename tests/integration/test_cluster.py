"""The operator's read models over a real redis-server: worker registry, queue depth and age (with a message that
Celery itself published), shard metrics, a job's timeline and its stalled flag."""

import time
from collections.abc import Iterator

import pytest
import redis
from celery import Celery

from shared.lifecycle import progress, shard_metrics
from shared.lifecycle.kinds import EXTRACT
from shared.lifecycle.queue import SHARD_QUEUE, ShardSender, task_id, task_name
from shared.lifecycle.schemas import DeadLetter, Manifest
from shared.ops import cluster, timeline
from shared.settings import Settings
from tests.integration.test_progress import make_job as make_progress_job


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    yield redis.Redis.from_url(redis_url)


def make_job(client: redis.Redis, job_id: str, *, shards: int, tokens_per_shard: int) -> None:
    job = make_progress_job(shards=shards, tokens_per_shard=tokens_per_shard).model_copy(update={"job_id": job_id})
    progress.register_job(client, job, "file:///storage", EXTRACT)


def _manifest(job_id: str, shard_index: int, tokens: int) -> Manifest:
    return Manifest(
        job_id=job_id,
        shard_index=shard_index,
        aux_layer_ids=[1, 3, 4],
        hidden_size=64,
        dtype="bfloat16",
        samples=[],
        num_samples=2,
        num_tokens=tokens,
        loss_tokens=tokens // 2,
        bytes=tokens * 512,
        worker="w",
        started_at="2026-12-01T00:00:00",
        committed_at="2026-12-01T00:00:01",
        timings_s={},
    )


def test_workers_are_listed_with_holdings_and_go_silent_without_beats(client: redis.Redis) -> None:
    now = time.time()
    cluster.beat(client, "worker-1@host", concurrency=2, now=now - 100)
    cluster.beat(client, "worker-2@host", concurrency=1, now=now)
    held = cluster.HeldShard(task_id="t1", task=task_name("extract"), job_id="job-a", shard_index=3, started_ts=now - 5)
    cluster.hold(client, "worker-1@host", held)

    workers = {w.name: w for w in cluster.list_workers(client, stale_after_s=45, now=now)}

    assert set(workers) == {"worker-1@host", "worker-2@host"}
    assert not workers["worker-1@host"].alive and workers["worker-1@host"].seconds_since_heartbeat == pytest.approx(100)
    assert workers["worker-1@host"].holding == [held]  # a silent worker still shows what it held
    assert workers["worker-2@host"].alive and workers["worker-2@host"].holding == []

    cluster.release(client, "worker-1@host", "t1")
    cluster.leave(client, "worker-2@host")
    workers = {w.name: w for w in cluster.list_workers(client, stale_after_s=45, now=now)}
    assert set(workers) == {"worker-1@host"} and workers["worker-1@host"].holding == []


def test_queue_depth_and_oldest_age_of_messages_the_producer_sent(redis_url: str, client: redis.Redis) -> None:
    assert cluster.queue_depth(client).depth == 0 and cluster.queue_depth(client).oldest_age_s is None
    sender = ShardSender(redis_url)
    sent = time.time()
    for k in range(3):
        sender.send("extract", "job-a", k)

    depth = cluster.queue_depth(client, now=sent + 30)
    assert depth.depth == 3 and depth.in_flight == 0
    assert depth.oldest_age_s == pytest.approx(30, abs=1)


def test_queue_age_falls_back_to_the_job_created_time_without_a_header(redis_url: str, client: redis.Redis) -> None:
    make_job(client, "job-old", shards=1, tokens_per_shard=10)
    created = float(client.hget(progress.job_key("job-old"), "created_ts"))
    # A message without the sent-time header (sent by an older producer): its job's creation time stands in.
    Celery("probe", broker=redis_url).send_task(
        task_name("extract"), args=["job-old", 0], queue=SHARD_QUEUE, task_id=task_id("extract", "job-old", 0)
    )
    assert cluster.queue_depth(client, now=created + 600).oldest_age_s == pytest.approx(600, abs=1)


def test_shard_histogram_is_cumulative_and_failures_count_by_reason(client: redis.Redis) -> None:
    for seconds in (0.2, 3.0, 3.5, 4000.0):
        shard_metrics.record_shard(client, task="extract", seconds=seconds, bytes_written=1000, tokens=10)
    shard_metrics.record_failure(client, task="extract", outcome="retry", reason="InferenceUnavailable")
    shard_metrics.record_failure(client, task="extract", outcome="retry", reason="InferenceUnavailable")
    shard_metrics.record_failure(client, task="extract", outcome="dead_lettered", reason="ModelMismatch")

    (histogram,) = shard_metrics.shard_histograms(client)
    buckets = dict(histogram.buckets)
    assert buckets[0.5] == 1 and buckets[2.5] == 1 and buckets[5.0] == 3 and buckets[3600.0] == 3
    assert buckets[float("inf")] == histogram.count == 4
    assert histogram.sum_s == pytest.approx(4006.7) and histogram.bytes_written == 4000
    counts = {(f.outcome, f.reason): f.count for f in shard_metrics.failure_counts(client)}
    assert counts == {("retry", "InferenceUnavailable"): 2, ("dead_lettered", "ModelMismatch"): 1}


def test_timeline_counts_every_committed_shard_once(client: redis.Redis) -> None:
    make_job(client, "job-t", shards=4, tokens_per_shard=100)
    for k in range(3):
        progress.record_commit(client, _manifest("job-t", k, 100))
    progress.record_commit(client, _manifest("job-t", 0, 100))  # a duplicate delivery
    letter = DeadLetter(job_id="job-t", shard_index=3, error_type="X", reason="r", retries=0, worker="w")
    progress.record_dead_letter(client, letter, num_samples=2, num_tokens=100)

    t = timeline.job_timeline(client, "job-t", points=10)

    assert len(t.points) == 10
    assert t.points[-1].tokens_done == 300 and t.points[-1].shards_committed == 3
    assert t.points[-1].shards_dead_lettered == 1
    assert sum(p.tokens_in_interval for p in t.points) == 300
    last = t.points[-timeline.SMOOTHING_INTERVALS :]
    expected_rate = sum(p.tokens_in_interval for p in last) / (timeline.SMOOTHING_INTERVALS * t.interval_s)
    assert t.points[-1].tokens_per_second == pytest.approx(expected_rate)
    assert [p.tokens_done for p in t.points] == sorted(p.tokens_done for p in t.points)


def test_a_job_that_commits_nothing_for_the_default_stall_time_is_stalled(client: redis.Redis) -> None:
    stall_after_s = Settings().stall_after_s  # the production default, by moving the clock rather than the limit
    make_job(client, "job-s", shards=2, tokens_per_shard=100)
    created = float(client.hget(progress.job_key("job-s"), "created_ts"))
    p = progress.job_progress(client, "job-s")

    fresh = timeline.job_activity(client, p, stall_after_s=stall_after_s, now=created + stall_after_s - 1)
    assert fresh.last_commit_ts is None and not fresh.stalled
    stuck = timeline.job_activity(client, p, stall_after_s=stall_after_s, now=created + stall_after_s + 1)
    assert stuck.stalled

    progress.record_commit(client, _manifest("job-s", 0, 100))
    p = progress.job_progress(client, "job-s")
    last = timeline.last_commit_ts(client, "job-s")
    assert last is not None and p.state == "running"
    assert not timeline.job_activity(client, p, stall_after_s=stall_after_s, now=last + 10).stalled
    assert timeline.job_activity(client, p, stall_after_s=stall_after_s, now=last + stall_after_s + 1).stalled

    progress.record_commit(client, _manifest("job-s", 1, 100))
    done = progress.job_progress(client, "job-s")
    assert done.state == "completed"
    assert not timeline.job_activity(client, done, stall_after_s=stall_after_s, now=last + 10 * stall_after_s).stalled
