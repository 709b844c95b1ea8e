"""A job finishes by itself when what drives it dies: its producer killed while it enqueues the shards, or Redis
restarted without its data. Storage is the truth in both cases; the workers' lease reaper runs both checks
(services/worker/leasing.py).

Publishing. A submit enters the job in `eagle3:publishing` (scored by Redis server time), writes job.json (from then
on the job is fully planned), registers the job in Redis, then enqueues one task per shard in order. Each enqueue
moves a checkpoint: `shards_enqueued` in the job's hash, and the job's score. A publishing that has not moved for
`shard_lease_s` lost its producer; a reaper takes it over and enqueues the rest, so a planned job is never left half
enqueued. A producer that died (or lost Redis) between job.json and the job's registration left a publishing with no
job hash: the reaper registers the job, its progress recounted from storage, and publishes it whole. A shard
sent twice (the producer died between an enqueue and its checkpoint) runs once: commits are create-only.

A message lost in flight. kombu's Redis transport pops a message from the queue and only then records it as
delivered; a Redis killed between the two (or a connection cut before the pop's reply arrived) loses it, with no
lease taken yet: its shard would never run, and its job would stay running for ever. A job that has committed
nothing for a while and whose shards no worker leases is looked at: a shard neither finished in storage nor in the
broker (queued or delivered) is sent again (`resend_lost_shards`).

Redis lost. Every published job has an entry in storage's job index (`_jobs/{job_id}`), and Redis holds a marker key
(`eagle3:state-marker`, a random value) that every worker reads when it starts. A reaper that finds the marker gone
or changed knows Redis lost its state since (restarted without persistence, flushed). Under a lock, one worker
re-registers every indexed job that Redis does not know, recounts its progress from the manifests and dead letters,
and publishes its unfinished shards as above; a job cancelled before (its `cancelled` object in storage) stays
cancelled, dead-lettered shards stay dead-lettered (an operator's `eagle3 resume` runs them). `eagle3 resume JOB`
does the same for one job, and is what a Redis needs that lost its state while no worker was running.
"""

import logging
import secrets
import time
from collections.abc import Callable

import redis

from shared.errors import JobNotFound
from shared.lifecycle import leases, progress
from shared.lifecycle.kinds import kind_of
from shared.lifecycle.queue import messages_in_broker, task_id
from shared.lifecycle.schemas import JobRecord
from shared.lifecycle.shards import load_job
from shared.redis_replies import members, text
from shared.storage import layout
from shared.storage.objects import ObjectNotFound, Storage

logger = logging.getLogger(__name__)

Enqueue = Callable[[str, str, int], None]  # (kind, job id, shard index): sends one shard task

PUBLISHING = "eagle3:publishing"
STATE_MARKER = "eagle3:state-marker"
RECOVERED_EPOCH = "eagle3:recovered-marker"  # the marker value whose jobs have been recovered
RECOVERY_LOCK = "eagle3:recovering"
RECOVERY_LOCK_S = 600  # a recovering worker that dies leaves the lock for this long at most
# Looking for shards the broker lost: a key per job, and one for the fleet's look, each expiring.
LOST_SHARDS_CHECK_PREFIX = "eagle3:lost-shards-checked:"
LOST_SHARDS_SWEEP = "eagle3:lost-shards-sweep"
_QUIET_FIELDS = (
    "kind",
    "shards_total",
    "shards_committed",
    "shards_dead",
    progress.CANCELLED,
    progress.DELETING,
    progress.CREATED_TS,
)

# ARGV: job id, shards enqueued so far. The score is the Redis server's clock, so that worker clocks may disagree.
# A job Redis lost meanwhile is not half-recreated: the Redis-loss recovery registers and publishes it whole.
_CHECKPOINT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], 'shards_enqueued', ARGV[2])
redis.call('ZADD', KEYS[2], tonumber(t[1]), ARGV[1])
return 1
"""

# KEYS: the job's hash, its look key; ARGV: the look's period in seconds. A job that a delete has marked (or removed)
# since the reaper read it is not looked at: the key would outlive the delete, which removes the job's look key once.
_CLAIM_LOOK = """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HGET', KEYS[1], 'deleting') == '1' then return 0 end
if redis.call('SET', KEYS[2], 1, 'NX', 'EX', tonumber(ARGV[1])) then return 1 end
return 0
"""

# ARGV: job id. Entered before job.json is written, so that a submit dying after it leaves a publishing to take over.
_BEGIN = """
local t = redis.call('TIME')
redis.call('ZADD', KEYS[1], tonumber(t[1]), ARGV[1])
"""

# Publishings whose checkpoint is older than ARGV[1] seconds; claiming one moves its score to now, so that of
# several reapers only one takes it over (until it too stops moving).
_CLAIM_STALLED = """
local t = redis.call('TIME')
local now = tonumber(t[1])
local stalled = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[1]), 'LIMIT', 0, tonumber(ARGV[2]))
for _, job_id in ipairs(stalled) do
  redis.call('ZADD', KEYS[1], now, job_id)
end
return stalled
"""


def lost_shards_check_key(job_id: str) -> str:
    """The key saying a reaper looked at the job for lost shards in the current period (it expires by itself)."""
    return f"{LOST_SHARDS_CHECK_PREFIX}{job_id}"


def claim_look(client: redis.Redis, job_id: str, quiet_for_s: float) -> bool:
    """Whether this reaper is the period's one to look at the job for lost shards; never for a job being deleted."""
    period = max(1, round(quiet_for_s))
    return bool(client.eval(_CLAIM_LOOK, 2, progress.job_key(job_id), lost_shards_check_key(job_id), period))


def index_job(storage: Storage, job_id: str) -> None:
    """The job's entry in storage's job index, which outlives Redis."""
    storage.put(layout.job_index_entry(job_id), b"")


def mark_index_deleting(storage: Storage, job_id: str, detail: bytes) -> None:
    """A job being deleted: its index entry holds what the delete was asked (JSON, never empty) until the delete ends
    by removing the entry; a published job's entry is empty (shared/lifecycle/deletion.py)."""
    storage.put(layout.job_index_entry(job_id), detail)


def deleting_detail(storage: Storage, job_id: str) -> bytes | None:
    """What a delete under way was asked, or None when the job is not being deleted."""
    try:
        return storage.get(layout.job_index_entry(job_id)) or None
    except ObjectNotFound:
        return None


def begin_publishing(client: redis.Redis, job_id: str) -> None:
    """Enter the job in the publishings a reaper watches; a submit calls this before job.json."""
    client.eval(_BEGIN, 1, PUBLISHING, job_id)


def publish(
    storage: Storage,
    client: redis.Redis,
    job: JobRecord,
    *,
    enqueue: Enqueue,
    start: int = 0,
    retry_dead: Callable[[int], None] | None = None,
) -> int:
    """Enqueue every shard from `start` on that has no manifest, checkpointing each; returns how many were sent. A
    dead-lettered shard is skipped, unless `retry_dead` is given (a resume): it clears the dead letter just before
    the shard is enqueued, so that a producer dying in between leaves it dead-lettered, never neither."""
    manifests, letters = layout.manifests_prefix(job.job_id), layout.dead_letter_prefix(job.job_id)
    committed = {layout.shard_index_from_manifest_key(k) for k in storage.list(manifests)}
    dead = {layout.shard_index_from_dead_letter_key(k) for k in storage.list(letters)} - committed
    keys = [progress.job_key(job.job_id), PUBLISHING]
    client.eval(_CHECKPOINT, 2, *keys, job.job_id, start)
    sent = 0
    for shard_index in range(start, job.shards_total):
        if shard_index not in committed and (shard_index not in dead or retry_dead is not None):
            if shard_index in dead and retry_dead is not None:
                retry_dead(shard_index)
            enqueue(job.kind, job.job_id, shard_index)
            sent += 1
        client.eval(_CHECKPOINT, 2, *keys, job.job_id, shard_index + 1)
    client.zrem(PUBLISHING, job.job_id)
    return sent


def take_over_stalled_publishing(
    storage: Storage, client: redis.Redis, *, enqueue: Enqueue, stalled_after_s: float, limit: int = 10
) -> list[str]:
    """Finish the publishing of every job whose producer stopped before registering it or while enqueueing its
    shards; returns their ids."""
    taken = []
    for raw in client.eval(_CLAIM_STALLED, 1, PUBLISHING, stalled_after_s, limit):
        job_id = raw.decode()
        try:
            job = load_job(storage, job_id)
        except JobNotFound:  # its submit died before job.json, or it was deleted since: nothing to enqueue
            client.zrem(PUBLISHING, job_id)
            continue
        if deleting_detail(storage, job_id) is not None:  # the delete under way finishes it
            client.zrem(PUBLISHING, job_id)
            continue
        if not client.exists(progress.job_key(job_id)):
            # Its submit stopped between job.json and the job's registration (the producer killed, Redis down).
            sent = recover_job(storage, client, job, enqueue=enqueue)
            client.zrem(PUBLISHING, job_id)  # also when it was cancelled meanwhile, and nothing was published
            logger.warning(
                "job %s: its submit stopped before the job was registered (no progress for %.0fs); registered it "
                "and enqueued %d shard(s)",
                job_id,
                stalled_after_s,
                sent,
            )
            taken.append(job_id)
            continue
        enqueued = int(client.hget(progress.job_key(job_id), progress.SHARDS_ENQUEUED) or 0)
        sent = publish(storage, client, job, enqueue=enqueue, start=enqueued)
        logger.warning(
            "job %s: its producer stopped after enqueueing %d of %d shards (no progress for %.0fs); "
            "enqueued the other %d",
            job_id,
            enqueued,
            job.shards_total,
            stalled_after_s,
            sent,
        )
        taken.append(job_id)
    return taken


def resend_lost_shards(
    storage: Storage, client: redis.Redis, *, enqueue: Enqueue, quiet_for_s: float
) -> list[tuple[str, int]]:
    """Send again each shard the broker lost: of every unfinished job that has committed nothing for `quiet_for_s`
    and has no leased shard, the shards that are neither committed nor dead-lettered in storage and whose message
    is neither queued nor delivered. A job is looked at once per `quiet_for_s` by one reaper. Returns the (job id,
    shard index) sent again."""
    quiet = _quiet_jobs(client, quiet_for_s)
    if not quiet:
        return []
    in_broker = messages_in_broker(client)  # read before the job's progress: a shard that commits since is counted
    if in_broker is None:  # a long queue: its jobs are looked at once it has drained
        logger.info("%d quiet job(s) not looked at for lost shards: the queue is long", len(quiet))
        for job_id, _, _ in quiet:
            client.delete(lost_shards_check_key(job_id))
        return []
    resent = []
    for job_id, kind, shards_total in quiet:
        finished = progress.committed_shards(client, job_id) | progress.dead_shards(client, job_id)
        missing = [
            k
            for k in range(shards_total)
            if k not in finished
            and task_id(kind, job_id, k) not in in_broker
            and not leases.shard_finished(storage, job_id, k)
        ]
        if not missing or not storage.exists(layout.job_json(job_id)):  # job.json goes last of a deleted job's objects
            continue
        for shard_index in missing:
            enqueue(kind, job_id, shard_index)
            leases.count_rerun(client, job_id)
            resent.append((job_id, shard_index))
        logger.warning(
            "job %s: shard(s) %s neither finished nor in the broker after %.0fs without a commit or a leased shard "
            "(a message lost in flight): sent again",
            job_id,
            ",".join(map(str, missing)),
            quiet_for_s,
        )
    return resent


def _quiet_jobs(client: redis.Redis, quiet_for_s: float) -> list[tuple[str, str, int]]:
    """(job id, kind, shards total) of the unfinished jobs, not being published, cancelled or deleted, that have
    committed nothing for `quiet_for_s`, whose shards no lease covers, and that no reaper looked at in that time.
    One reaper of the fleet looks a quarter period (the others find the look taken)."""
    if not client.set(LOST_SHARDS_SWEEP, 1, nx=True, ex=max(1, round(quiet_for_s / 4))):
        return []
    leased = {lease.job_id for lease in leases.held(client)}
    publishing = {text(m) for m in members(client.zrange(PUBLISHING, 0, -1))}
    candidates = [j for j in progress.all_job_ids(client) if j not in leased and j not in publishing]
    with client.pipeline(transaction=False) as pipe:
        for job_id in candidates:
            pipe.hmget(progress.job_key(job_id), list(_QUIET_FIELDS))
        replies = pipe.execute()
    now = time.time()
    quiet = []
    for job_id, reply in zip(candidates, replies, strict=True):
        fields = dict(zip(_QUIET_FIELDS, (text(f) if f is not None else None for f in reply), strict=True))
        kind, total = fields["kind"], fields["shards_total"]
        if kind is None or total is None or int(fields[progress.CANCELLED] or 0) or int(fields[progress.DELETING] or 0):
            continue
        if int(fields["shards_committed"] or 0) + int(fields["shards_dead"] or 0) >= int(total):
            continue  # every shard finished (a finalizing kind's last step is the kind's own)
        newest = progress.newest_event_ts(client, job_id)
        last = newest if newest is not None else float(fields[progress.CREATED_TS] or now)
        if now - last < quiet_for_s:
            continue
        if claim_look(client, job_id, quiet_for_s):  # one look a period at a job
            quiet.append((job_id, kind, int(total)))
    return quiet


class RedisState:
    """One worker's memory of the Redis state it works with: the value of Redis's marker key, which a Redis that lost
    its data no longer has. A worker adopts the marker when it starts (and creates it in a new Redis); a later look
    that finds it gone or different means Redis lost its state since, and the jobs are recovered from storage. A
    Redis found empty by workers that all start after the loss looks new: its jobs need `eagle3 resume`."""

    def __init__(self, holder: str) -> None:
        self.holder = holder
        self.epoch: str | None = None

    def adopt(self, client: redis.Redis) -> None:
        if self.epoch is None:
            self.epoch = _marker(client)

    def check(self, storage: Storage, client: redis.Redis, *, enqueue: Enqueue) -> list[str]:
        """Recover the jobs if Redis lost its state since the last look (one worker does it, under a lock);
        returns the ids of the jobs recovered here."""
        current = _marker(client)
        if self.epoch is None:
            self.epoch = current
        if current == self.epoch:
            return []
        if client.get(RECOVERED_EPOCH) == current.encode():  # another worker has recovered them
            self.epoch = current
            return []
        if not client.set(RECOVERY_LOCK, self.holder, nx=True, ex=RECOVERY_LOCK_S):
            return []  # another worker is at it; the next look sees whether it finished
        started = time.monotonic()
        try:
            recovered = recover_jobs(storage, client, enqueue=enqueue)
            client.set(RECOVERED_EPOCH, current)
        finally:
            client.delete(RECOVERY_LOCK)
        self.epoch = current
        logger.warning(
            "Redis had lost its state (marker %s gone): %d job(s) recovered from storage in %.1fs",
            STATE_MARKER,
            len(recovered),
            time.monotonic() - started,
        )
        return recovered


def _marker(client: redis.Redis) -> str:
    """The marker's value, created if Redis has none (a new Redis, or one that lost its state)."""
    client.set(STATE_MARKER, secrets.token_hex(8), nx=True)
    marker = client.get(STATE_MARKER)
    assert marker is not None  # set just above, without an expiry
    return text(marker)


def recover_jobs(storage: Storage, client: redis.Redis, *, enqueue: Enqueue) -> list[str]:
    """Register and publish every job of storage's index that Redis does not know; returns their ids."""
    recovered = []
    for key in storage.list(layout.JOB_INDEX_PREFIX):
        job_id = key.removeprefix(layout.JOB_INDEX_PREFIX)
        if client.exists(progress.job_key(job_id)):
            continue  # registered since the loss (a new submit): it is being published
        try:
            job = load_job(storage, job_id)
        except JobNotFound:
            continue  # its submit died before job.json: there is no job
        if deleting_detail(storage, job_id) is not None:
            # A delete was under way: the job shows as deleting (nothing enqueued) until the delete runs again.
            progress.register_job(client, job, storage.url, kind_of(job.kind))
            progress.mark_deleting(client, job_id)
            logger.warning("job %s was being deleted when Redis lost its state: run `eagle3 delete` again", job_id)
            continue
        recovered.append(job_id)
        sent = recover_job(storage, client, job, enqueue=enqueue)
        logger.warning("job %s recovered from storage after Redis lost its state: %d shard(s) enqueued", job_id, sent)
    return recovered


def recover_job(storage: Storage, client: redis.Redis, job: JobRecord, *, enqueue: Enqueue) -> int:
    """Register a job Redis does not know, with its progress recounted from storage, and publish its unfinished
    shards unless it was cancelled; returns how many shards were enqueued."""
    kind = kind_of(job.kind)
    progress.register_job(client, job, storage.url, kind)
    progress.rebuild(client, storage, job, kind)
    if storage.exists(layout.cancelled(job.job_id)):
        progress.mark_cancelled(client, job.job_id)
        return 0
    sent = publish(storage, client, job, enqueue=enqueue)
    committed = progress.committed_shards(client, job.job_id)
    pending = [k for k in range(job.shards_total) if k not in committed]
    # What else the kind runs again (a regenerate job whose shards are all committed assembles its output again:
    # whether it had was in Redis).
    again = kind.after_resume(storage, client, job, pending)
    for shard_index in again:
        enqueue(job.kind, job.job_id, shard_index)
    return sent + len(again)
