"""Progress accounting in Redis: exactly-once counters per committed or dead-lettered shard, shard events,
and the token-weighted view (rate, ETA, bytes, budget) that the API, the CLI and /metrics all show.

Storage is the truth (a shard exists iff its manifest exists); Redis holds counters that `rebuild()`
can recompute from storage at any time. Beside the counters here, a job kind may declare counters of its own
(JobKind.counters), which its manifests add to; the callers, which know the job's kind, pass it in (CountedKind).
"""

import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

import redis
from pydantic import BaseModel
from redis.backoff import ExponentialBackoff
from redis.retry import Retry
from redis.typing import EncodableT, FieldT

from shared.errors import JobNotFound
from shared.lifecycle.schemas import (
    DeadLetter,
    JobRecord,
    JobState,
    Manifest,
    Progress,
    RegenerationManifest,
)
from shared.redis_replies import members, stream_entries, text, text_hash
from shared.storage import layout
from shared.storage.objects import Storage

logger = logging.getLogger(__name__)

JOBS_INDEX = "eagle3:jobs"
# Every job's bytes_stored summed: kept by each commit, recounted from the jobs' hashes where a job's bytes change
# otherwise (a rebuild, a delete) and by the producer's upkeep; what the storage budget reads once a shard, where
# summing the hashes would cost a read of every job Redis keeps.
BYTES_STORED_TOTAL = "eagle3:bytes-stored"
# Fields of the job hash that modules besides this one read or write (through the functions below where they write).
BYTES_STORED = "bytes_stored"  # committed samples' bytes, what the storage budgets count (shared/lifecycle/budget.py)
CANCELLED = "cancelled"
DELETING = "deleting"  # set by shared/lifecycle/deletion.py (and recovery.py) before anything of the job is removed
CREATED_TS = "created_ts"  # the job's registration, seconds since the epoch
FINALIZED = "finalized"  # a finalizing kind's last step done (shared/lifecycle/kinds/regenerate.py)
FINALIZE_ERROR = "finalize_error"
STORAGE_BUDGET = "storage_budget_bytes"  # a job's own budget as set while it runs (shared/lifecycle/budget.py)
SHARDS_ENQUEUED = "shards_enqueued"  # the publishing checkpoint: shards sent so far (shared/lifecycle/recovery.py)
COUNTERS = (
    "samples_done",
    "tokens_done",
    BYTES_STORED,
    "shards_committed",
    "shards_dead",
    "samples_failed",
    "tokens_failed",
)
# Fields of the job hash that are not numbers.
_TEXT_FIELDS = (
    "storage_url",
    "created_at",
    CREATED_TS,
    "kind",
    "counter_names",
    FINALIZE_ERROR,
    "paused_reason",
)


class CountedKind(Protocol):
    """What progress needs of a job's kind (a shared/lifecycle/kind.JobKind, which progress does not import: the kind
    contract loads torch through the capture protocol, and the kinds sit above progress): the counters of its own that
    its manifests add to, whether its jobs run a last step after their final shard, and how much of the job a
    dead-lettered shard takes."""

    @property
    def counters(self) -> Mapping[str, str]: ...  # a class variable of each JobKind

    @property
    def finalizes(self) -> bool: ...  # likewise

    def dead_shard_size(self, storage: Storage, job_id: str, shard_index: int) -> tuple[int, int]: ...

    def progress_fields(self, job: JobRecord) -> dict[FieldT, EncodableT]: ...


# A job kind's part of its jobs' progress (JobKind.progress), by kind name, filled by the registry (shared/lifecycle/
# kinds) like JobSpec's options: from the job hash's numbers and text and whether the job has finished, its tokens
# total and its own fields of Progress.
KindProgress = Callable[[Mapping[str, int], Mapping[str, str], bool], tuple[int, dict[str, Any]]]
KIND_PROGRESS: dict[str, KindProgress] = {}


REDIS_OUTAGE_ERRORS = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)
_OUTAGE_BACKOFF_CAP_S = 2.0


def connect(url: str, *, outage_wait_s: float) -> redis.Redis:
    """A client for the workers and the trainer whose calls ride out a Redis restart or failover of about
    `outage_wait_s` (backoff up to 2 s a try). The writes here are idempotent (a shard counts once), so a call
    retried after a lost reply does no harm."""
    retries = math.ceil(outage_wait_s / _OUTAGE_BACKOFF_CAP_S) + 4  # the first tries back off less than the cap
    return redis.Redis.from_url(
        url,
        socket_timeout=30,
        socket_connect_timeout=10,
        retry=Retry(ExponentialBackoff(cap=_OUTAGE_BACKOFF_CAP_S, base=0.1), retries),
        retry_on_error=list(REDIS_OUTAGE_ERRORS),
    )


def job_key(job_id: str) -> str:
    return f"eagle3:job:{job_id}"


def committed_key(job_id: str) -> str:
    return f"eagle3:job:{job_id}:committed"


def dead_key(job_id: str) -> str:
    return f"eagle3:job:{job_id}:dead"


def events_key(job_id: str) -> str:
    """The shard event stream the trainer follows (XADD per committed or dead-lettered shard)."""
    return f"eagle3:job:{job_id}:events"


# Counting happens in one script so a redelivered shard, or two workers committing the same shard,
# can never count twice: set membership decides, atomically, whether this commit is the first.
# A job Redis no longer knows (Redis lost without persistence) is not half-recreated: `resume` recounts it from storage.
_RECORD_COMMIT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if redis.call('SADD', KEYS[2], ARGV[1]) == 0 then return 0 end
redis.call('HDEL', KEYS[1], 'paused_reason')  -- a manifest was written: storage has room again
if redis.call('SREM', KEYS[3], ARGV[1]) == 1 then
  redis.call('HINCRBY', KEYS[1], 'shards_dead', -1)
  redis.call('HINCRBY', KEYS[1], 'samples_failed', -tonumber(ARGV[2]))
  redis.call('HINCRBY', KEYS[1], 'tokens_failed', -tonumber(ARGV[3]))
end
redis.call('HINCRBY', KEYS[1], 'shards_committed', 1)
redis.call('HINCRBY', KEYS[1], 'samples_done', ARGV[2])
redis.call('HINCRBY', KEYS[1], 'tokens_done', ARGV[3])
redis.call('HINCRBY', KEYS[1], 'bytes_stored', ARGV[4])
redis.call('INCRBY', KEYS[5], ARGV[4])
for i = 6, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
end
redis.call('XADD', KEYS[4], '*', 'event', 'committed', 'shard_index', ARGV[1], 'samples', ARGV[2],
           'tokens', ARGV[3], 'bytes', ARGV[4], 'manifest', ARGV[5])
return 1
"""

_RECORD_DEAD = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then return 0 end
if redis.call('SADD', KEYS[3], ARGV[1]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[1], 'shards_dead', 1)
redis.call('HINCRBY', KEYS[1], 'samples_failed', ARGV[2])
redis.call('HINCRBY', KEYS[1], 'tokens_failed', ARGV[3])
redis.call('XADD', KEYS[4], '*', 'event', 'dead_lettered', 'shard_index', ARGV[1], 'samples', ARGV[2],
           'tokens', ARGV[3], 'reason', ARGV[4])
return 1
"""


# Like a commit, a pause never half-recreates a job Redis no longer knows.
_RECORD_PAUSE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'paused_reason', ARGV[1])
return 1
"""


def _keys(job_id: str) -> list[str]:
    return [job_key(job_id), committed_key(job_id), dead_key(job_id), events_key(job_id)]


def register_job(client: redis.Redis, job: JobRecord, storage_url: str, kind: CountedKind) -> None:
    """The job's hash (its plan's numbers, every counter at zero, its kind's too) and its entry in the job list."""
    created = time.time()
    with client.pipeline() as pipe:
        pipe.hset(
            job_key(job.job_id),
            mapping={
                "kind": job.kind,
                "finalizes": int(kind.finalizes),
                "counter_names": ",".join(kind.counters),  # which fields job_progress reports as the kind's
                **kind.progress_fields(job),
                **{name: 0 for name in kind.counters},
                "storage_url": storage_url,
                CREATED_TS: created,
                "created_at": job.created_at,
                "samples_total": job.samples_total,
                "samples_rejected": job.samples_rejected,
                "tokens_total": job.tokens_total,
                "shards_total": job.shards_total,
                "projected_bytes": job.projected_bytes,
                **{name: 0 for name in COUNTERS},
            },
        )
        pipe.zadd(JOBS_INDEX, {job.job_id: created})
        pipe.execute()


def record_commit(client: redis.Redis, manifest: Manifest | RegenerationManifest) -> bool:
    """Count a committed shard once (with the counters of its kind its manifest carries); True if this call
    counted it."""
    args: list[str | int] = [
        manifest.shard_index,
        manifest.num_samples,
        manifest.num_tokens,
        manifest.bytes,
        layout.manifest(manifest.job_id, manifest.shard_index),
    ]
    for name, value in getattr(manifest, "counters", {}).items():
        args += [name, value]
    return bool(client.eval(_RECORD_COMMIT, 5, *_keys(manifest.job_id), BYTES_STORED_TOTAL, *args))


# KEYS: the total, then every job's hash. One script: no commit's increment lands between the sum and the write.
_RECOUNT_BYTES_STORED = """
local total = 0
for i = 2, #KEYS do
  total = total + tonumber(redis.call('HGET', KEYS[i], 'bytes_stored') or '0')
end
redis.call('SET', KEYS[1], total)
return total
"""


def recount_bytes_stored(client: redis.Redis) -> int:
    """BYTES_STORED_TOTAL summed again from every job's hash; returns it."""
    hashes = [job_key(job_id) for job_id in all_job_ids(client)]
    return int(client.eval(_RECOUNT_BYTES_STORED, 1 + len(hashes), BYTES_STORED_TOTAL, *hashes))


def bytes_stored_total(client: redis.Redis) -> int:
    """Every job's committed bytes: the kept total, recounted first where Redis has none yet."""
    value = client.get(BYTES_STORED_TOTAL)
    return int(value) if value is not None else recount_bytes_stored(client)


AnyManifest = TypeVar("AnyManifest", Manifest, RegenerationManifest)


def commit_manifest(storage: Storage, client: redis.Redis, manifest: AnyManifest) -> AnyManifest:
    """Write a shard's manifest create-only (the shard exists from then on) and count it once. A concurrent delivery
    that committed first wins: its manifest is read back, counted (once) and returned instead."""
    key = layout.manifest(manifest.job_id, manifest.shard_index)
    if not storage.put_if_absent(key, manifest.model_dump_json(indent=1).encode()):
        manifest = type(manifest).model_validate_json(storage.get(key))
        logger.info(
            "shard already committed by another delivery job=%s shard=%d", manifest.job_id, manifest.shard_index
        )
    record_commit(client, manifest)
    return manifest


def record_pause(client: redis.Redis, job_id: str, reason: str) -> None:
    """The job cannot go on for a reason outside its shards (storage full): its state is `paused` with this reason
    until the next shard commits."""
    client.eval(_RECORD_PAUSE, 1, job_key(job_id), reason[:2000])


def mark_finalized(client: redis.Redis, job_id: str, *, chained_job_id: str | None, error: str | None) -> None:
    """A regenerate job's dataset is assembled (and its chained job submitted, or why not)."""
    fields: dict[FieldT, EncodableT] = {FINALIZED: 1}
    if chained_job_id is not None:
        fields["chained_job_id"] = chained_job_id
    if error is not None:
        fields[FINALIZE_ERROR] = error[:2000]
    client.hset(job_key(job_id), mapping=fields)


def is_finalized(client: redis.Redis, job_id: str) -> bool:
    return client.hget(job_key(job_id), FINALIZED) == b"1"


def retry_failed_finalize(client: redis.Redis, job_id: str) -> None:
    """A resume of a job whose last step failed: the error and the finalized mark go, so that the step runs again."""
    if client.hdel(job_key(job_id), FINALIZE_ERROR):
        client.hdel(job_key(job_id), FINALIZED)


def record_finalize_error(client: redis.Redis, job_id: str, error: str) -> None:
    """Assembling or chaining failed for good: the job ends completed_with_errors, with the reason."""
    client.hset(job_key(job_id), mapping={FINALIZE_ERROR: error[:2000]})


def record_dead_letter(client: redis.Redis, letter: DeadLetter, *, num_samples: int, num_tokens: int) -> bool:
    args: list[str | int] = [letter.shard_index, num_samples, num_tokens, letter.reason[:2000]]
    return bool(client.eval(_RECORD_DEAD, 4, *_keys(letter.job_id), *args))


def cancel(client: redis.Redis, job_id: str) -> None:
    require_job(client, job_id)
    mark_cancelled(client, job_id)


def mark_cancelled(client: redis.Redis, job_id: str) -> None:
    client.hset(job_key(job_id), CANCELLED, 1)


def uncancel(client: redis.Redis, job_id: str) -> None:
    """A resumed job is no longer cancelled."""
    client.hdel(job_key(job_id), CANCELLED)


def mark_deleting(client: redis.Redis, job_id: str) -> None:
    """The job is being deleted: it shows `deleting`, and as cancelled nothing of it runs."""
    client.hset(job_key(job_id), mapping={DELETING: 1, CANCELLED: 1})


def is_cancelled(client: redis.Redis, job_id: str) -> bool:
    return client.hget(job_key(job_id), CANCELLED) == b"1"


def created_ts(client: redis.Redis, job_id: str) -> float | None:
    """When the job was registered (seconds since the epoch), None for a job Redis does not know."""
    value = client.hget(job_key(job_id), CREATED_TS)
    return float(value) if value is not None else None


def require_job(client: redis.Redis, job_id: str) -> dict[str, str]:
    fields = text_hash(client.hgetall(job_key(job_id)))
    if not fields:
        raise JobNotFound(job_id)
    return fields


def list_jobs(client: redis.Redis, limit: int = 100) -> list[str]:
    return [text(j) for j in members(client.zrevrange(JOBS_INDEX, 0, limit - 1))]


def all_job_ids(client: redis.Redis) -> list[str]:
    """Every job Redis knows, oldest first (list_jobs shows the newest hundred)."""
    return [text(j) for j in members(client.zrange(JOBS_INDEX, 0, -1))]


class _CommittedShard(BaseModel):
    """What counting needs of a manifest of either kind."""

    shard_index: int
    num_samples: int
    num_tokens: int
    bytes: int
    counters: dict[str, int] = {}


def rebuild(client: redis.Redis, storage: Storage, job: JobRecord, kind: CountedKind) -> None:
    """Recompute every counter from storage (manifests and dead letters are the truth), the kind's own included."""
    shards: dict[int, tuple[int, int]] = {}
    committed: list[_CommittedShard] = []
    for key in storage.list(layout.manifests_prefix(job.job_id)):
        committed.append(_CommittedShard.model_validate_json(storage.get(key)))
    dead: list[DeadLetter] = []
    committed_indices = {m.shard_index for m in committed}
    for key in storage.list(layout.dead_letter_prefix(job.job_id)):
        letter = DeadLetter.model_validate_json(storage.get(key))
        if letter.shard_index not in committed_indices:
            dead.append(letter)
    for letter in dead:
        shards[letter.shard_index] = kind.dead_shard_size(storage, job.job_id, letter.shard_index)
    counters = (*COUNTERS, *kind.counters)
    with client.pipeline() as pipe:
        pipe.delete(committed_key(job.job_id), dead_key(job.job_id))
        pipe.hset(job_key(job.job_id), mapping={name: 0 for name in counters})
        for m in committed:
            pipe.sadd(committed_key(job.job_id), m.shard_index)
            pipe.hincrby(job_key(job.job_id), "shards_committed", 1)
            pipe.hincrby(job_key(job.job_id), "samples_done", m.num_samples)
            pipe.hincrby(job_key(job.job_id), "tokens_done", m.num_tokens)
            pipe.hincrby(job_key(job.job_id), BYTES_STORED, m.bytes)
            for name, value in m.counters.items():
                pipe.hincrby(job_key(job.job_id), name, value)
        for letter in dead:
            samples, tokens = shards[letter.shard_index]
            pipe.sadd(dead_key(job.job_id), letter.shard_index)
            pipe.hincrby(job_key(job.job_id), "shards_dead", 1)
            pipe.hincrby(job_key(job.job_id), "samples_failed", samples)
            pipe.hincrby(job_key(job.job_id), "tokens_failed", tokens)
        pipe.execute()
    recount_bytes_stored(client)  # the job's bytes were counted anew


def committed_shards(client: redis.Redis, job_id: str) -> set[int]:
    return {int(i) for i in client.smembers(committed_key(job_id))}


def dead_shards(client: redis.Redis, job_id: str) -> set[int]:
    return {int(i) for i in client.smembers(dead_key(job_id))}


def forget_dead_letter(
    client: redis.Redis, job_id: str, shard_index: int, *, num_samples: int, num_tokens: int
) -> None:
    """A dead-lettered shard that is queued again (resume) is no longer counted as failed."""
    if client.srem(dead_key(job_id), shard_index):
        with client.pipeline() as pipe:
            pipe.hincrby(job_key(job_id), "shards_dead", -1)
            pipe.hincrby(job_key(job_id), "samples_failed", -num_samples)
            pipe.hincrby(job_key(job_id), "tokens_failed", -num_tokens)
            pipe.execute()


def newest_event_ts(client: redis.Redis, job_id: str) -> float | None:
    """When the job's newest event (a commit, a dead letter) happened, from its stream entry's id; None if none."""
    newest = stream_entries(client.xrevrange(events_key(job_id), count=1))
    return int(newest[0][0].split(b"-")[0]) / 1000 if newest else None


def _recent_rate(
    client: redis.Redis, job_id: str, *, now: float, window_s: float, started: float
) -> tuple[float, float]:
    """Tokens/s over the last `window_s`, and the time of the newest event."""
    since_ms = int((now - window_s) * 1000)
    entries = stream_entries(client.xrange(events_key(job_id), min=f"{since_ms}-0", max="+"))
    newest = newest_event_ts(client, job_id)
    last_event = newest if newest is not None else started
    tokens = sum(int(fields[b"tokens"]) for _, fields in entries if fields[b"event"] == b"committed")
    span = min(window_s, max(now - started, 1e-3))
    return tokens / span, last_event


def job_progress(
    client: redis.Redis, job_id: str, *, window_s: float = 60.0, budget_bytes: int | None = None
) -> Progress:
    fields = require_job(client, job_id)
    # Every other field is a number, but those a kind keeps as text for its part (progress_fields).
    number = {k: n for k, v in fields.items() if k not in _TEXT_FIELDS and (n := _number(v)) is not None}
    kind = fields.get("kind", "extract")  # register_job wrote a JobRecord's kind
    # What the job's kind declared when the job was registered; a job registered before kinds declared it: the one
    # kind that finalized then.
    finalizes = bool(number.get("finalizes", kind == "regenerate"))
    counters = {name: number.get(name, 0) for name in fields.get("counter_names", "").split(",") if name}
    started = float(fields[CREATED_TS])
    now = time.time()
    rate, last_event = _recent_rate(client, job_id, now=now, window_s=window_s, started=started)
    shards_total = number["shards_total"]
    finished_shards = number["shards_committed"] + number["shards_dead"]
    state: JobState
    if number.get(DELETING):  # set by shared/lifecycle/deletion.py before it removes anything
        state = "deleting"
    elif number.get(CANCELLED):
        state = "cancelled"
    elif finished_shards >= shards_total:
        # A finalizing kind's failed samples are found, and its last step fails, without a dead shard.
        finalizing_errors = finalizes and (number["samples_failed"] > 0 or FINALIZE_ERROR in fields)
        if finalizes and not number["shards_dead"] and not number.get(FINALIZED):
            # Every shard is committed; the last worker runs the kind's last step (a regenerate job: assembling the
            # dataset and submitting the chain).
            state = "completed_with_errors" if FINALIZE_ERROR in fields else "running"
        elif number["shards_dead"] or finalizing_errors:
            state = "completed_with_errors"
        else:
            state = "completed"
    elif "paused_reason" in fields:
        state = "paused"
    elif finished_shards:
        state = "running"
    else:
        state = "queued"
    finished = state not in ("running", "queued", "paused")
    tokens_done = number["tokens_done"]
    kind_progress = KIND_PROGRESS.get(kind)
    if kind_progress is None:
        raise RuntimeError(f"job kind {kind!r} is not registered: import shared.lifecycle.kinds before progress")
    tokens_total, kind_fields = kind_progress(number, fields, finished)
    bytes_per_token = (
        number[BYTES_STORED] / tokens_done if tokens_done else number["projected_bytes"] / max(tokens_total, 1)
    )
    projected = round(bytes_per_token * tokens_total)
    remaining_tokens = tokens_total - tokens_done - number["tokens_failed"]
    eta = 0.0 if finished else (remaining_tokens / rate if rate > 0 else None)
    elapsed = (last_event if finished else now) - started
    return Progress(
        job_id=job_id,
        state=state,
        samples_total=number["samples_total"],
        samples_done=number["samples_done"],
        samples_rejected=number["samples_rejected"],
        samples_failed=number["samples_failed"],
        tokens_total=tokens_total,
        tokens_done=tokens_done,
        tokens_failed=number["tokens_failed"],
        shards_total=shards_total,
        shards_committed=number["shards_committed"],
        shards_dead_lettered=number["shards_dead"],
        shards_rerun=number.get("shards_rerun", 0),
        bytes_stored=number[BYTES_STORED],
        bytes_per_token=bytes_per_token,
        projected_total_bytes=projected,
        storage_budget_bytes=budget_bytes,
        budget_headroom_bytes=None if budget_bytes is None else budget_bytes - projected,
        tokens_per_second=tokens_done / elapsed if finished and elapsed > 0 else rate,
        eta_seconds=eta,
        elapsed_seconds=max(elapsed, 0.0),
        created_at=fields["created_at"],
        kind=kind,
        counters=counters,
        **kind_fields,
        paused_reason=fields.get("paused_reason") if state == "paused" else None,
    )


def _number(value: str) -> int | None:
    try:
        return int(float(value))
    except (ValueError, OverflowError):
        return None
