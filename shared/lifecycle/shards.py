"""One shard of a job of any kind, on a worker: the lifecycle every kind shares.

already committed -> cancelled -> load the job -> check the served model (once per job and process, kept for its
recent jobs) -> load the shard input -> reuse what an earlier attempt wrote -> the kind's work -> commit the manifest
create-only and count it once -> the kind's after-commit step. A task that fails for good leaves a dead letter with
its reason. Storage that is full, or still unreachable after the retries, pauses the job instead (progress state
`paused`, with the reason): the shard waits for storage, which is also where a dead letter would have to go.

Every step is idempotent, so a redelivered or duplicated task never produces a second or a torn shard.
"""

import logging
import time
from typing import Any, Literal

import redis
from pydantic import BaseModel

from shared.errors import ConfigurationError, Eagle3Error, InferenceUnavailable, JobNotFound
from shared.lifecycle import budget, progress
from shared.lifecycle.kind import JobKind, ShardContext, read_shard_input
from shared.lifecycle.schemas import DeadLetter, JobRecord, utc_now
from shared.storage import layout
from shared.storage.objects import ObjectNotFound, Storage

logger = logging.getLogger(__name__)


class Cancelled(Eagle3Error):
    """The job was cancelled while its shard ran; what is done stays for a resume."""


class ShardOutcome(BaseModel):
    """What a shard task returns (and logs): the committed shard's size, or why nothing was done."""

    job_id: str
    shard_index: int
    status: Literal["committed", "already_committed", "cancelled"]
    num_samples: int = 0
    num_tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0


def load_job(storage: Storage, job_id: str) -> JobRecord:
    try:
        return JobRecord.model_validate_json(storage.get(layout.job_json(job_id)))
    except ObjectNotFound as exc:
        raise JobNotFound(job_id) from exc


def _outcome(manifest: Any, status: Literal["committed", "already_committed"], seconds: float = 0.0) -> ShardOutcome:
    return ShardOutcome(
        job_id=manifest.job_id,
        shard_index=manifest.shard_index,
        status=status,
        num_samples=manifest.num_samples,
        num_tokens=manifest.num_tokens,
        bytes=manifest.bytes,
        seconds=seconds,
    )


def run_shard(kind: JobKind, job_id: str, shard_index: int, ctx: ShardContext) -> ShardOutcome:
    """Run one shard of a job: commit its manifest, or find it committed or cancelled. A full or unreachable store
    raises StorageUnavailable; the task decides when the shard runs again (services/worker/tasks.py)."""
    started, started_at = time.monotonic(), utc_now()
    storage, client = ctx.storage, ctx.redis
    state = ctx.state(kind)
    manifest_key = layout.manifest(job_id, shard_index)
    if storage.exists(manifest_key):
        manifest = kind.manifest_type.model_validate_json(storage.get(manifest_key))
        # A worker that died between commit and count (or in the after-commit step) left work; both are idempotent.
        progress.record_commit(client, manifest)
        kind.after_commit(ctx, state, load_job(storage, job_id))
        return _outcome(manifest, "already_committed")
    if progress.is_cancelled(client, job_id):
        return ShardOutcome(job_id=job_id, shard_index=shard_index, status="cancelled")

    job = load_job(storage, job_id)
    if job.kind != kind.name:
        raise ConfigurationError(f"job {job_id} is of kind {job.kind!r}, not {kind.name!r}")
    prepared = ctx.prepared.get(job_id, lambda: kind.prepare(ctx, state, job))
    shard = read_shard_input(kind, storage, job_id, shard_index)

    items = kind.items(shard)
    # Before anything is written, the shard's bytes must fit in the storage budgets; OverStorageBudget pauses the job.
    projected = budget.shard_bytes(job, *kind.shard_size(shard))
    with budget.reserved(client, ctx.settings, job, shard_index, projected) as reservation:
        done: dict[int, Any] = {}
        pending = []
        for item in items:
            key = kind.item_key(job_id, item)
            if storage.exists(key):  # written by an earlier attempt that died before the manifest
                done[item.sample_index] = kind.reuse(item, key, storage.get(key))
            else:
                pending.append(item)
        try:
            manifest = kind.process(ctx, state, prepared, job, shard, pending, done)
        except Cancelled:
            logger.info("cancelled job=%s shard=%d", job_id, shard_index)
            return ShardOutcome(job_id=job_id, shard_index=shard_index, status="cancelled")
        except InferenceUnavailable:
            # The server went away (killed, restarting): the retry waits until it is ready again, as at the first
            # shard, instead of spending its attempts on refused connections while the model loads.
            ctx.prepared.forget(job_id)
            raise
        manifest.worker, manifest.started_at, manifest.committed_at = ctx.worker, started_at, utc_now()
        manifest.timings_s["total"] = round(time.monotonic() - started, 4)
        reservation.settle(manifest.bytes)
        manifest = progress.commit_manifest(storage, client, manifest)
    seconds = time.monotonic() - started
    logger.info(
        "committed %s job=%s shard=%d samples=%d tokens=%d bytes=%d in %.2fs (%d reused)",
        kind.name,
        job_id,
        shard_index,
        manifest.num_samples,
        manifest.num_tokens,
        manifest.bytes,
        seconds,
        len(items) - len(pending),
    )
    kind.after_commit(ctx, state, job)
    return _outcome(manifest, "committed", seconds)


def pause(ctx: ShardContext, job_id: str, shard_index: int, reason: str) -> None:
    """The shard waits for storage: the job's state is `paused` with this reason until a shard commits again."""
    logger.warning("job=%s shard=%d paused: %s", job_id, shard_index, reason)
    try:
        progress.record_pause(ctx.redis, job_id, reason)
    except redis.RedisError as exc:
        logger.warning("cannot record the pause of job %s: %s", job_id, exc)


def dead_letter(
    kind: JobKind, job_id: str, shard_index: int, error: BaseException, *, retries: int, ctx: ShardContext
) -> DeadLetter | None:
    """A shard task failed for good. Uncommitted: record the shard with its reason (its samples count as failed;
    resume runs it again), also when its input cannot be read. Committed: the kind's after-commit step failed."""
    storage, client = ctx.storage, ctx.redis
    reason = f"{type(error).__name__}: {error}"
    if isinstance(error, JobNotFound):
        # The job was deleted (or never planned) while its message waited: a letter would recreate its folder.
        logger.warning("job=%s shard=%d: the job does not exist (deleted), nothing to record", job_id, shard_index)
        return None
    if storage.exists(layout.manifest(job_id, shard_index)):
        if not kind.after_failure(ctx, job_id, shard_index, reason):
            logger.error("job=%s shard=%d failed after its commit: %s", job_id, shard_index, reason)
        return None
    letter = DeadLetter(
        job_id=job_id,
        shard_index=shard_index,
        error_type=type(error).__name__,
        reason=str(error),
        retries=retries,
        worker=ctx.worker,
    )
    samples, tokens = kind.dead_shard_size(storage, job_id, shard_index)
    storage.put(layout.dead_letter(job_id, shard_index), letter.model_dump_json(indent=1).encode())
    progress.record_dead_letter(client, letter, num_samples=samples, num_tokens=tokens)
    logger.error("dead-lettered job=%s shard=%d after %d retries: %s", job_id, shard_index, retries, reason)
    return letter
