"""Cluster-wide shard statistics kept in Redis, so that /metrics on any producer replica shows every worker's shards:
a latency histogram and bytes written per task kind, and failures by outcome and reason.

Workers have no metrics port of their own (they scale to any number, without fixed names); each finished shard adds
to these counters instead, and the producer exports them at scrape time. Counters only grow, as Prometheus expects;
`rate()` over them gives shards/s, bytes/s and failures/s.
"""

import math

import redis
from pydantic import BaseModel

from shared.redis_replies import text, text_hash

# Shard durations vary from seconds (a small CPU shard) to an hour (a large GPU shard behind a slow store).
LATENCY_BUCKETS_S = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, math.inf)
_SHARDS = "eagle3:metrics:shards"  # hash: "{task}|{field}" -> count or sum
_FAILURES = "eagle3:metrics:failures"  # hash: "{task}|{outcome}|{reason}" -> count
RECENT_SHARDS = 32  # shards whose rate says what the cluster's servers do now (a job's `shard_seconds`)


def _recent(task: str) -> str:
    return f"eagle3:metrics:recent:{task}"  # list, newest first: "{tokens} {seconds}" of the last shards


class ShardHistogram(BaseModel):
    task: str
    buckets: list[tuple[float, int]]  # (upper bound, cumulative count), as Prometheus histograms are
    sum_s: float
    count: int
    bytes_written: int
    tokens_written: int


class FailureCount(BaseModel):
    task: str
    outcome: str  # "retry" (will run again) or "dead_lettered" (gave up, recorded with its reason)
    reason: str  # the exception type
    count: int


def _bucket_label(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(bound)


def record_shard(client: redis.Redis, *, task: str, seconds: float, bytes_written: int, tokens: int) -> None:
    bound = next(b for b in LATENCY_BUCKETS_S if seconds <= b)
    with client.pipeline() as pipe:
        pipe.hincrby(_SHARDS, f"{task}|le={_bucket_label(bound)}", 1)
        pipe.hincrbyfloat(_SHARDS, f"{task}|sum_s", seconds)
        pipe.hincrby(_SHARDS, f"{task}|count", 1)
        pipe.hincrby(_SHARDS, f"{task}|bytes", bytes_written)
        pipe.hincrby(_SHARDS, f"{task}|tokens", tokens)
        pipe.lpush(_recent(task), f"{tokens} {seconds}")
        pipe.ltrim(_recent(task), 0, RECENT_SHARDS - 1)
        pipe.execute()


def recent_rate(client: redis.Redis, task: str) -> float | None:
    """Tokens per second of one shard task (one worker and its server) over the last shards of that kind, any
    worker's; None before the first."""
    tokens = seconds = 0.0
    for entry in client.lrange(_recent(task), 0, -1):
        shard_tokens, shard_seconds = text(entry).split()
        tokens, seconds = tokens + float(shard_tokens), seconds + float(shard_seconds)
    return tokens / seconds if seconds > 0 else None


def record_failure(client: redis.Redis, *, task: str, outcome: str, reason: str) -> None:
    client.hincrby(_FAILURES, f"{task}|{outcome}|{reason}", 1)


def shard_histograms(client: redis.Redis) -> list[ShardHistogram]:
    raw = text_hash(client.hgetall(_SHARDS))
    tasks = sorted({key.split("|", 1)[0] for key in raw})
    histograms = []
    for task in tasks:
        cumulative, buckets = 0, []
        for bound in LATENCY_BUCKETS_S:
            cumulative += int(raw.get(f"{task}|le={_bucket_label(bound)}", 0))
            buckets.append((bound, cumulative))
        histograms.append(
            ShardHistogram(
                task=task,
                buckets=buckets,
                sum_s=float(raw.get(f"{task}|sum_s", 0.0)),
                count=int(raw.get(f"{task}|count", 0)),
                bytes_written=int(raw.get(f"{task}|bytes", 0)),
                tokens_written=int(raw.get(f"{task}|tokens", 0)),
            )
        )
    return histograms


def failure_counts(client: redis.Redis) -> list[FailureCount]:
    counts = []
    for key, value in sorted(client.hgetall(_FAILURES).items()):
        task, outcome, reason = text(key).split("|", 2)
        counts.append(FailureCount(task=task, outcome=outcome, reason=reason, count=int(value)))
    return counts
