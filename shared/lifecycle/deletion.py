"""Deleting a job, the retention that deletes finished jobs past an age, and the trimming that bounds what Redis keeps
of finished jobs.

A delete never leaves half a job that looks whole. It refuses a job that still runs (unless asked to cancel it first)
and one a running trainer follows (unless forced), then, in this order:

1. marks the job deleting, durably: its storage index entry (`_jobs/{job_id}`) holds what the delete was asked, and
   its Redis hash says `deleting` (and `cancelled`, so that no queued shard of it runs). From here on status, the job
   list and the API show the state `deleting`; a submit of the same id and a resume are refused;
2. removes the job's objects in batches (S3 DeleteObjects, 1000 keys a request; files and their emptied folders on a
   local store), job.json last of them; `{job}/trainer/` (checkpoints, curves, exports under a run) stays unless
   asked;
3. removes every Redis key of the job but its hash: the committed and dead-lettered sets, the shard events, the
   followers, its shard leases, its budget reservations, its publishing checkpoint;
4. removes the hash and the job's place in the job list, then the index entry. Never the other way round: a hash
   left saying deleting and cancelled with nothing of the job in storage would let a submit of the same id through,
   and register the new job into it (deleting, its shards skipped; the next delete would remove it).

Killed, or with storage or Redis down at any step, the job stays `deleting` (the index entry or the hash says so; a
Redis that lost its state meanwhile gets the job back as `deleting` from the index, shared/lifecycle/recovery.py), and
running the delete again finishes it: every step is idempotent. Stopped between the two marks of step 1, nothing is
removed yet and the job shows its former state (a resume is refused); stopped within step 4, only its index entry is
left, which refuses a submit of the id.
"""

import json
import logging
import re
import time
from datetime import UTC, datetime

import redis
from pydantic import BaseModel

from shared.errors import DeleteRefused, JobNotFound
from shared.lifecycle import budget, followers, leases, progress, recovery
from shared.lifecycle.schemas import Progress
from shared.settings import Settings
from shared.storage import layout
from shared.storage.objects import Storage

logger = logging.getLogger(__name__)

DELETE_BATCH = 1000  # keys handed to storage at a time (S3's DeleteObjects limit)
RUNNING_STATES = ("queued", "running", "paused")
FINISHED_STATES = ("completed", "completed_with_errors", "cancelled")
# A finished job keeps its newest shard events for the dashboard's timeline (a job of up to this many shards keeps
# all of them, about 200 bytes each); the rest goes once no trainer follows the job.
FINISHED_EVENTS_KEPT = 1000
# A cancelled job's queued shards end at once (they find it cancelled), a running one with its current run, and one
# waiting for storage (paused) when its wait is over: a delete waits that long for them (stop_wait_s).
SHARDS_STOP_WAIT_S = 10.0
MAINTENANCE_LOCK = "eagle3:maintenance"  # one producer replica applies retention at a time

_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class DeleteReport(BaseModel):
    job_id: str
    objects_deleted: int
    objects_kept: int  # trainer checkpoints and curves left under {job}/trainer/
    redis_keys_deleted: int
    cancelled: bool  # the job was running and the delete cancelled it first
    finished_earlier_delete: bool  # a delete had begun before (killed or interrupted) and this one ended it


def parse_age(text: str) -> float:
    """'7d', '12h', '30m', '90s', '2w' -> seconds."""
    match = _AGE.match(text)
    if match is None:
        raise ValueError(f"age {text!r}: a number and a unit, one of s, m, h, d, w (e.g. 7d)")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def stop_wait_s(settings: Settings) -> float:
    """How long a delete waits for a cancelled job's shards to end: a paused shard's wait, and a little."""
    return settings.storage_wait_s + SHARDS_STOP_WAIT_S


def _state(client: redis.Redis, job_id: str) -> str | None:
    try:
        return progress.job_progress(client, job_id).state
    except JobNotFound:
        return None


def delete_job(
    job_id: str,
    *,
    storage: Storage,
    client: redis.Redis,
    cancel: bool = False,
    force: bool = False,
    with_checkpoints: bool = False,
    wait_s: float = SHARDS_STOP_WAIT_S,
) -> DeleteReport:
    """Delete a job's objects, Redis keys and index entry (see the module's doc for the order and the refusals).
    Raises JobNotFound when nothing of the job exists, DeleteRefused when it runs, a trainer follows it, or a shard of
    it still runs after wait_s."""
    earlier = recovery.deleting_detail(storage, job_id)
    state = _state(client, job_id)
    # Checkpoints kept by an earlier delete are all that is left of a job; asked for, they go too.
    in_storage = (
        earlier is not None
        or storage.exists(layout.job_json(job_id))
        or (with_checkpoints and bool(storage.list(layout.trainer_prefix(job_id))))
    )
    if not in_storage and state is None:
        raise JobNotFound(job_id)
    resuming = earlier is not None or state == "deleting"
    cancelled = False
    if not resuming and state in RUNNING_STATES:
        if not cancel:
            raise DeleteRefused(
                f"job {job_id} is {state}: cancel it first (`eagle3 cancel {job_id}`), or delete with --cancel"
            )
        progress.cancel(client, job_id)  # queued shards are skipped from now on; running ones end below
        cancelled = True
    running = _wait_for_running_shards(client, job_id, wait_s)
    if running:
        raise DeleteRefused(
            f"job {job_id}: shard(s) {', '.join(str(lease.shard_index) for lease in running)} still running on "
            f"{', '.join(sorted({lease.holder for lease in running}))}; a cancelled job's shards end with their "
            "current run: delete again once they have"
        )
    following = followers.live_followers(client, job_id)
    if following and not force:
        raise DeleteRefused(
            f"job {job_id} is followed by a running trainer ({', '.join(following)}): stop it, or delete with --force"
        )
    if earlier is not None:  # a delete asked to remove the checkpoints too is not narrowed by the re-run
        with_checkpoints = with_checkpoints or bool(json.loads(earlier).get("with_checkpoints"))

    # 1. Mark: storage first (it outlives Redis), then Redis, which also stops the job's queued shards.
    detail = {"deleting_since": datetime.now(UTC).isoformat(timespec="seconds"), "with_checkpoints": with_checkpoints}
    if in_storage:
        recovery.mark_index_deleting(storage, job_id, json.dumps(detail).encode())
    if state is not None:
        progress.mark_deleting(client, job_id)
    logger.warning("deleting job %s%s", job_id, " (again: an earlier delete did not finish)" if resuming else "")

    # 2. Objects, job.json last: until then a Redis that lost its state can register the job again as deleting.
    keys = storage.list(f"{job_id}/")
    keep = not with_checkpoints
    kept = [k for k in keys if keep and k.startswith(layout.trainer_prefix(job_id))]
    doomed = [
        k for k in keys if not (keep and k.startswith(layout.trainer_prefix(job_id))) and k != layout.job_json(job_id)
    ]
    for start in range(0, len(doomed), DELETE_BATCH):
        storage.delete_many(doomed[start : start + DELETE_BATCH])
    storage.delete_many([layout.job_json(job_id)])
    deleted = len(doomed) + (layout.job_json(job_id) in keys)

    # 3. Every Redis key of the job but its hash, which shows `deleting` until the last step.
    redis_keys = _delete_redis_keys(client, job_id)

    # 4. The hash, then the index entry: the job is gone. The index entry outlives the hash, so that a submit of the
    # same id is refused until nothing of the job is left in Redis to register the new job into.
    with client.pipeline() as pipe:
        pipe.delete(progress.job_key(job_id))
        pipe.zrem(progress.JOBS_INDEX, job_id)
        removed = pipe.execute()
    progress.recount_bytes_stored(client)  # the job's bytes leave what the storage budget counts
    storage.delete(layout.job_index_entry(job_id))
    logger.warning("deleted job %s: %d objects (%d kept under trainer/)", job_id, deleted, len(kept))
    return DeleteReport(
        job_id=job_id,
        objects_deleted=deleted,
        objects_kept=len(kept),
        redis_keys_deleted=redis_keys + int(removed[0]),
        cancelled=cancelled,
        finished_earlier_delete=resuming,
    )


def _wait_for_running_shards(client: redis.Redis, job_id: str, wait_s: float) -> list[leases.Lease]:
    """The job's shards that a worker holds, after waiting up to wait_s for them to end: their files would land after
    the listing and outlive the delete."""
    deadline = time.monotonic() + wait_s
    while True:
        running = [lease for lease in leases.held(client) if lease.job_id == job_id]
        if not running or time.monotonic() >= deadline:
            return running
        time.sleep(0.5)


def _delete_redis_keys(client: redis.Redis, job_id: str) -> int:
    """The job's sets, stream, followers, leases, reservations, publishing checkpoint and a reaper's look at it for
    lost shards; how many keys went."""
    own = [
        progress.committed_key(job_id),
        progress.dead_key(job_id),
        progress.events_key(job_id),
        followers.followers_key(job_id),
        recovery.lost_shards_check_key(job_id),
    ]
    mine = [lease for lease in leases.held(client) if lease.job_id == job_id]
    with client.pipeline() as pipe:
        pipe.delete(*own)
        for lease in mine:
            pipe.delete(leases.LEASE_PREFIX + lease.lease_id)
            pipe.zrem(leases.LEASES, lease.lease_id)
        pipe.zrem(recovery.PUBLISHING, job_id)
        counts = pipe.execute()
    budget.forget_job(client, job_id)
    return int(counts[0]) + len(mine)


def finished_at(client: redis.Redis, p: Progress) -> float:
    """When a finished job finished (its last shard event, else its creation), Unix seconds."""
    created = float(progress.require_job(client, p.job_id)[progress.CREATED_TS])
    return created + p.elapsed_seconds  # a finished job's elapsed time ends at its last event


def expired_jobs(client: redis.Redis, max_age_s: float, *, now: float | None = None) -> list[Progress]:
    """Finished jobs (completed, with errors, or cancelled) that finished more than max_age_s ago, oldest first."""
    now = time.time() if now is None else now
    found = []
    for job_id in progress.all_job_ids(client):
        try:
            p = progress.job_progress(client, job_id)
            if p.state in FINISHED_STATES and now - (ended := finished_at(client, p)) > max_age_s:
                found.append((ended, p))
        except JobNotFound:
            continue  # deleted between the listing and the read
    return [p for _, p in sorted(found, key=lambda pair: pair[0])]


def trim_finished_events(client: redis.Redis) -> list[str]:
    """Bound the shard events of every finished job no trainer follows to its newest FINISHED_EVENTS_KEPT; returns the
    jobs trimmed. A regenerate job counts as finished once its output is assembled (its state says so)."""
    trimmed = []
    for job_id in progress.all_job_ids(client):
        try:
            finished = progress.job_progress(client, job_id).state in FINISHED_STATES
        except JobNotFound:
            continue
        if (
            finished
            and not followers.live_followers(client, job_id)
            and client.xtrim(progress.events_key(job_id), maxlen=FINISHED_EVENTS_KEPT, approximate=False)
        ):
            trimmed.append(job_id)
    return trimmed


def maintain(storage: Storage, client: redis.Redis, settings: Settings) -> list[DeleteReport]:
    """One round of the producer's upkeep: trim finished jobs' events; with EAGLE3_RETENTION_DAYS, delete the finished
    jobs past it (checkpoints kept; a job a trainer follows waits). Returns the deletes done."""
    if not client.set(MAINTENANCE_LOCK, "1", nx=True, ex=max(60, round(settings.maintenance_interval_s))):
        return []  # another producer replica is at it
    try:
        trimmed = trim_finished_events(client)
        if trimmed:
            logger.info("trimmed the shard events of %d finished job(s)", len(trimmed))
        if settings.retention_days is None:
            return []
        reports = []
        for p in expired_jobs(client, settings.retention_days * 86400):
            try:
                reports.append(delete_job(p.job_id, storage=storage, client=client, wait_s=stop_wait_s(settings)))
            except (DeleteRefused, JobNotFound) as exc:  # followed now, or gone meanwhile: the next round sees
                logger.info("retention: job %s not deleted: %s", p.job_id, exc)
        if reports:
            logger.warning(
                "retention (%s days): deleted %d finished job(s): %s",
                settings.retention_days,
                len(reports),
                ", ".join(r.job_id for r in reports),
            )
        return reports
    finally:
        client.delete(MAINTENANCE_LOCK)
