"""Shard leases: a shard whose worker dies runs again within about a minute, not after the broker's
visibility timeout.

The broker keeps an unacknowledged message invisible for `visibility_timeout_s` (hours, so that a slow, healthy
shard is never delivered twice). A worker that is killed whole (node lost, OOM kill of the main process, spot
preemption, `docker kill`) never returns its message, so without leases its shard would wait out those hours.

A worker takes a lease when it receives a shard message and renews it while it holds the message (every
`shard_lease_s / 4`); it releases the lease when the message is acknowledged or returned to the queue. Every
worker runs a reaper every `lease_reaper_interval_s`: it claims expired leases atomically (one reaper wins each),
and queues the shard again when its manifest does not exist. A slow shard keeps its lease as long as its worker is
alive, so it is not run twice on purpose; a run that does happen twice is harmless (create-only commits).

A message can also be in the broker as delivered with no lease at all: Redis killed after it recorded the delivery
(kombu's `unacked` hash) and before the worker's lease reached it, a restart from the append-only file that kept the
one and lost the other, or a reaper's claim of an expired lease kept and its restore of the message lost. No lease
expires for it, and only the visibility timeout (hours) would return it. The reapers also sweep those deliveries
(`return_unleased`): one that has no lease a lease period after it was received goes back to the queue.

Redis holds the leases: a sorted set of lease ids scored by expiry, and a hash per lease. Expiries are computed
from the Redis server's clock (TIME in the scripts), so worker clocks may disagree.
"""

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import redis

from shared.lifecycle import progress
from shared.lifecycle.queue import Delivery, deliveries_before, drop_delivery
from shared.redis_replies import members, text, text_hash
from shared.storage import layout
from shared.storage.objects import Storage

logger = logging.getLogger(__name__)

LEASES = "eagle3:leases"
LEASE_PREFIX = "eagle3:lease:"
UNLEASED_SWEEP = "eagle3:unleased-sweep"  # held by the reaper that sweeps the unleased deliveries this interval
RERUN_FIELD = "shards_rerun"


@dataclass(frozen=True)
class Lease:
    """Who holds which delivery of a shard task."""

    task: str
    task_id: str
    job_id: str
    shard_index: int
    holder: str
    delivery_tag: str
    acquired_at: float = 0.0  # Redis server time (Unix seconds) when this delivery took the lease

    @property
    def lease_id(self) -> str:
        return lease_id(self.task, self.job_id, self.shard_index)


@dataclass(frozen=True)
class ExpiredLease:
    lease: Lease
    expired_for_s: float


def lease_id(task: str, job_id: str, shard_index: int) -> str:
    return f"{task}|{job_id}|{shard_index}"


_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
"""

# The newest delivery of a shard owns its lease: a redelivered message is the one that runs now.
_ACQUIRE = (
    _NOW
    + """
redis.call('HSET', KEYS[2], 'holder', ARGV[1], 'delivery_tag', ARGV[2], 'task', ARGV[3], 'task_id', ARGV[4],
           'job_id', ARGV[5], 'shard_index', ARGV[6], 'acquired_at', tostring(now))
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[7]), ARGV[8])
"""
)

# ARGV: holder, lease seconds, prefix, then (lease id, delivery tag) pairs. Only leases still ours are extended:
# one a reaper claimed (deleted) or a newer delivery took over is left alone.
_RENEW = (
    _NOW
    + """
local renewed = 0
for i = 4, #ARGV, 2 do
  local key = ARGV[3] .. ARGV[i]
  local owner = redis.call('HMGET', key, 'holder', 'delivery_tag')
  if owner[1] == ARGV[1] and owner[2] == ARGV[i + 1] then
    redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[2]), ARGV[i])
    renewed = renewed + 1
  end
end
return renewed
"""
)

_RELEASE = """
local owner = redis.call('HMGET', KEYS[2], 'holder', 'delivery_tag')
if owner[1] ~= ARGV[1] or owner[2] ~= ARGV[2] then return 0 end
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[1], ARGV[3])
return 1
"""

# A run that ended without an outcome the reaper can trust: its lease expires now (if still this delivery's), and
# the next reaper looks in storage whether the shard needs sending again.
_HAND_BACK = (
    _NOW
    + """
local owner = redis.call('HMGET', KEYS[2], 'holder', 'delivery_tag')
if owner[1] ~= ARGV[1] or owner[2] ~= ARGV[2] then return 0 end
redis.call('ZADD', KEYS[1], 'XX', now, ARGV[3])
return 1
"""
)

# Removing the id from the sorted set is the claim: of several reapers, exactly one gets each expired lease.
_CLAIM_EXPIRED = (
    _NOW
    + """
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[1]))
local claimed = {}
for i = 1, #expired, 2 do
  local id = expired[i]
  if redis.call('ZREM', KEYS[1], id) == 1 then
    local key = ARGV[2] .. id
    table.insert(claimed, {id, tostring(now - tonumber(expired[i + 1])), redis.call('HGETALL', key)})
    redis.call('DEL', key)
  end
end
return claimed
"""
)

# Only a job that still exists is counted: a lease can outlive the job's Redis state (Redis lost, job deleted).
_COUNT_RERUN = """
if redis.call('EXISTS', KEYS[1]) == 1 then return redis.call('HINCRBY', KEYS[1], ARGV[1], 1) end
return 0
"""


def acquire(client: redis.Redis, lease: Lease, lease_s: float) -> None:
    client.eval(
        _ACQUIRE,
        2,
        LEASES,
        LEASE_PREFIX + lease.lease_id,
        lease.holder,
        lease.delivery_tag,
        lease.task,
        lease.task_id,
        lease.job_id,
        lease.shard_index,
        lease_s,
        lease.lease_id,
    )


def renew(client: redis.Redis, holder: str, leases: Iterable[Lease], lease_s: float) -> int:
    """Extend the leases `holder` still owns by `lease_s` from now; returns how many were extended."""
    pairs = [value for lease in leases for value in (lease.lease_id, lease.delivery_tag)]
    if not pairs:
        return 0
    return int(client.eval(_RENEW, 1, LEASES, holder, lease_s, LEASE_PREFIX, *pairs))


def release(client: redis.Redis, lease: Lease) -> bool:
    """Drop the lease if it is still this delivery's; True if it was."""
    return bool(
        client.eval(
            _RELEASE, 2, LEASES, LEASE_PREFIX + lease.lease_id, lease.holder, lease.delivery_tag, lease.lease_id
        )
    )


def hand_back(client: redis.Redis, lease: Lease) -> bool:
    """Let the lease expire now if it is still this delivery's (the next reaper decides); True if it was."""
    return bool(
        client.eval(
            _HAND_BACK, 2, LEASES, LEASE_PREFIX + lease.lease_id, lease.holder, lease.delivery_tag, lease.lease_id
        )
    )


def claim_expired(client: redis.Redis, limit: int = 100) -> list[ExpiredLease]:
    """Take the expired leases out of Redis; the caller must queue their shards again."""
    claimed: list[ExpiredLease] = []
    for _, expired_for, flat in client.eval(_CLAIM_EXPIRED, 1, LEASES, limit, LEASE_PREFIX):
        fields = {flat[i].decode(): flat[i + 1].decode() for i in range(0, len(flat), 2)}
        if fields:  # empty: released between ZADD and HSET of a racing acquire, nothing to recover
            claimed.append(ExpiredLease(_lease(fields), float(expired_for)))
    return claimed


def held(client: redis.Redis) -> list[Lease]:
    """Every lease currently in Redis (for status pages and tests)."""
    leases = []
    for raw_id in members(client.zrange(LEASES, 0, -1)):
        fields = text_hash(client.hgetall(LEASE_PREFIX + text(raw_id)))
        if fields:
            leases.append(_lease(fields))
    return leases


def _lease(fields: dict[str, str]) -> Lease:
    return Lease(
        task=fields["task"],
        task_id=fields["task_id"],
        job_id=fields["job_id"],
        shard_index=int(fields["shard_index"]),
        holder=fields["holder"],
        delivery_tag=fields["delivery_tag"],
        acquired_at=float(fields.get("acquired_at", 0.0)),
    )


def count_rerun(client: redis.Redis, job_id: str) -> None:
    """One more run of a shard of this job after its holder failed (progress `shards_rerun`)."""
    client.eval(_COUNT_RERUN, 1, progress.job_key(job_id), RERUN_FIELD)


def shard_finished(storage: Storage, job_id: str, shard_index: int) -> bool:
    """Committed (its manifest exists) or given up on (dead-lettered): nothing to run again."""
    return storage.exists(layout.manifest(job_id, shard_index)) or storage.exists(
        layout.dead_letter(job_id, shard_index)
    )


def reap(
    client: redis.Redis,
    storage: Storage,
    *,
    restore: Callable[[Lease], bool],
    resend: Callable[[Lease], None],
    limit: int = 100,
) -> list[ExpiredLease]:
    """Queue again every shard whose lease expired. `restore` puts the holder's unacknowledged message back on the
    queue (False if the broker no longer has it); `resend` sends a new message for the shard. Returns the leases of
    the shards queued again."""
    requeued = []
    for expired in claim_expired(client, limit):
        try:
            if _requeue(client, storage, expired, restore=restore, resend=resend):
                requeued.append(expired)
        except Exception:
            # Claimed but not queued: put the lease back, expired, so that the next reaper tries again.
            acquire(client, expired.lease, 0)
            raise
    return requeued


def _requeue(
    client: redis.Redis,
    storage: Storage,
    expired: ExpiredLease,
    *,
    restore: Callable[[Lease], bool],
    resend: Callable[[Lease], None],
) -> bool:
    lease = expired.lease
    finished = shard_finished(storage, lease.job_id, lease.shard_index)
    # Even a finished shard's message goes back if the broker still holds it: a run of a committed shard only
    # counts it (a worker can die between commit and count) and acknowledges it, instead of hours later.
    restored = restore(lease)
    if not storage.exists(layout.job_json(lease.job_id)):
        return False  # deleted (job.json goes last of its objects): a run would only find it gone
    if finished:
        committed = storage.exists(layout.manifest(lease.job_id, lease.shard_index))
        if (
            committed
            and not restored
            and not client.sismember(progress.committed_key(lease.job_id), str(lease.shard_index))
        ):
            # Committed while Redis was away for longer than a worker waits, and its message given up meanwhile:
            # nothing else would count it. A run of it only counts it.
            resend(lease)
            logger.warning(
                "shard %d of job %s: committed but not counted, sent again to be counted",
                lease.shard_index,
                lease.job_id,
            )
        return False
    if progress.is_cancelled(client, lease.job_id):
        return False
    if not restored:
        resend(lease)
    count_rerun(client, lease.job_id)
    logger.warning(
        "shard %d of job %s queued again: worker %s stopped renewing its lease (expired %.0fs ago; %s)",
        lease.shard_index,
        lease.job_id,
        lease.holder,
        expired.expired_for_s,
        "message restored" if restored else "message lost by the broker, sent again",
    )
    return True


def return_unleased(
    client: redis.Redis,
    storage: Storage,
    *,
    older_than_s: float,
    every_s: float,
    restore: Callable[[Delivery], bool],
) -> list[Delivery]:
    """Return to the queue each shard message the broker has held as delivered for over `older_than_s` (a lease
    period: a live worker leases what it receives at once) while its shard has no lease. `restore` puts it back on
    the queue, kombu's restore as at the visibility timeout (False if it was acknowledged meanwhile). A shard leased
    by any delivery is left to that lease; a committed and counted shard's message, a dead-lettered shard's and a
    deleted job's are removed instead, since nothing is left to run (a committed shard Redis has not counted goes
    back: its run only counts it). One reaper of the fleet sweeps every `every_s`. Returns the messages restored."""
    if not client.set(UNLEASED_SWEEP, 1, nx=True, ex=max(1, round(every_s))):
        return []
    deliveries = deliveries_before(client, time.time() - older_than_s)
    if not deliveries:
        return []
    with client.pipeline(transaction=False) as pipe:
        for delivery in deliveries:
            pipe.exists(LEASE_PREFIX + lease_id(delivery.task, delivery.job_id, delivery.shard_index))
        leased = pipe.execute()
    restored = []
    for delivery, has_lease in zip(deliveries, leased, strict=True):
        if has_lease:  # its holder renews it, or the reaper returns the shard once it expires
            continue
        job_id, shard_index = delivery.job_id, delivery.shard_index
        if not storage.exists(layout.job_json(job_id)):
            drop_delivery(client, delivery.delivery_tag)  # deleted: a run would only find it gone
            continue
        committed = storage.exists(layout.manifest(job_id, shard_index))
        counted = committed and bool(client.sismember(progress.committed_key(job_id), str(shard_index)))
        if counted or (not committed and storage.exists(layout.dead_letter(job_id, shard_index))):
            drop_delivery(client, delivery.delivery_tag)  # nothing left to run or count
            continue
        if not restore(delivery):
            continue
        count_rerun(client, job_id)
        restored.append(delivery)
        logger.warning(
            "shard %d of job %s was delivered %.0fs ago and has no lease (Redis lost it, or never got it): its "
            "message returned to the queue",
            shard_index,
            job_id,
            time.time() - delivery.delivered_at,
        )
    return restored
