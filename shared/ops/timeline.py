"""A job over time, from its shard event stream: committed tokens and shards per interval (the dashboard's charts),
when the last shard was committed, and whether a job that should be making progress has stalled."""

import time

import redis
from pydantic import BaseModel

from shared.lifecycle import progress
from shared.lifecycle.schemas import Progress
from shared.redis_replies import stream_entries

_PAGE = 5000  # stream entries read per round trip
SMOOTHING_INTERVALS = 5  # a point's rate covers this many intervals: shards commit in bursts, not per interval


class TimelinePoint(BaseModel):
    ts: float  # end of the interval (unix seconds)
    tokens_done: int  # committed by then
    shards_committed: int
    shards_dead_lettered: int
    tokens_in_interval: int
    tokens_per_second: float  # over the last SMOOTHING_INTERVALS intervals up to this one


class JobTimeline(BaseModel):
    job_id: str
    started_ts: float
    interval_s: float
    points: list[TimelinePoint]


class JobActivity(BaseModel):
    """Whether a job is moving: what `tokens_per_second == 0` cannot tell apart (just started, or stalled)."""

    last_commit_ts: float | None  # None: nothing committed yet
    seconds_since_commit: float  # since the last commit, or since the job was created
    stalled: bool  # queued or running, and nothing committed for `stall_after_s`
    stall_after_s: float


class JobOverview(BaseModel):
    progress: Progress
    activity: JobActivity


def job_timeline(client: redis.Redis, job_id: str, *, points: int = 120, now: float | None = None) -> JobTimeline:
    """`points` equal intervals from the job's creation to its last event (or now, while it runs)."""
    fields = progress.require_job(client, job_id)
    started = float(fields[progress.CREATED_TS])
    now = time.time() if now is None else now
    events = _events(client, job_id)
    finished = progress.job_progress(client, job_id).finished
    end = max(events[-1][0] if finished and events else now, started + 1e-3)
    interval = (end - started) / points
    tokens = [0] * points
    committed = [0] * points
    dead = [0] * points
    for ts, kind, shard_tokens in events:
        i = min(max(int((ts - started) / interval), 0), points - 1)
        if kind == "committed":
            tokens[i] += shard_tokens
            committed[i] += 1
        else:
            dead[i] += 1
    timeline, total_tokens, total_committed, total_dead = [], 0, 0, 0
    for i in range(points):
        total_tokens += tokens[i]
        total_committed += committed[i]
        total_dead += dead[i]
        recent = tokens[max(0, i - SMOOTHING_INTERVALS + 1) : i + 1]
        timeline.append(
            TimelinePoint(
                ts=started + (i + 1) * interval,
                tokens_done=total_tokens,
                shards_committed=total_committed,
                shards_dead_lettered=total_dead,
                tokens_in_interval=tokens[i],
                tokens_per_second=sum(recent) / (len(recent) * interval),
            )
        )
    return JobTimeline(job_id=job_id, started_ts=started, interval_s=interval, points=timeline)


def _events(client: redis.Redis, job_id: str) -> list[tuple[float, str, int]]:
    """(time, committed|dead_lettered, tokens) of every shard event, oldest first."""
    out: list[tuple[float, str, int]] = []
    start = "-"
    while True:
        entries = stream_entries(client.xrange(progress.events_key(job_id), min=start, max="+", count=_PAGE))
        for entry_id, fields in entries:
            out.append((_entry_ts(entry_id), fields[b"event"].decode(), int(fields.get(b"tokens", 0))))
        if len(entries) < _PAGE:
            return out
        start = "(" + entries[-1][0].decode()


def last_commit_ts(client: redis.Redis, job_id: str) -> float | None:
    """When the newest committed shard event was added (dead letters are not progress)."""
    end = "+"
    while True:
        entries = stream_entries(client.xrevrange(progress.events_key(job_id), max=end, min="-", count=100))
        for entry_id, fields in entries:
            if fields[b"event"] == b"committed":
                return _entry_ts(entry_id)
        if len(entries) < 100:
            return None
        end = "(" + entries[-1][0].decode()


def job_activity(client: redis.Redis, p: Progress, *, stall_after_s: float, now: float | None = None) -> JobActivity:
    now = time.time() if now is None else now
    last = last_commit_ts(client, p.job_id)
    since = now - (last if last is not None else float(progress.require_job(client, p.job_id)[progress.CREATED_TS]))
    return JobActivity(
        last_commit_ts=last,
        seconds_since_commit=max(since, 0.0),
        stalled=p.state in ("queued", "running", "paused") and since > stall_after_s,
        stall_after_s=stall_after_s,
    )


def job_overview(
    client: redis.Redis, job_id: str, *, window_s: float, budget_bytes: int | None, stall_after_s: float
) -> JobOverview:
    p = progress.job_progress(client, job_id, window_s=window_s, budget_bytes=budget_bytes)
    return JobOverview(progress=p, activity=job_activity(client, p, stall_after_s=stall_after_s))


def _entry_ts(entry_id: bytes) -> float:
    return int(entry_id.split(b"-")[0]) / 1000
