"""Storage budgets that hold while jobs run: the store-wide one (EAGLE3_STORAGE_BUDGET_BYTES) and each job's own
(JobSpec.storage_budget_bytes).

What counts is what is stored, measured: every job's `bytes_stored` (the sum of its committed manifests), the rest
of the store as the producer last measured it (`measure_other_bytes`: job files, shard inputs and manifests, trainer
checkpoints and exports, regenerated outputs, anything else in the bucket), plus what running shards have reserved.
Before a shard writes anything, it reserves its projected size (its share of the job's projection) in one Redis
script that sees every job's stored bytes (their total, progress.BYTES_STORED_TOTAL, which each commit keeps: a read of
one key however many jobs Redis keeps) and every reservation; a shard that does not fit raises
OverStorageBudget, a StorageFull: the job pauses with the reason, the shard runs again every
EAGLE3_STORAGE_WAIT_S without spending attempts, and goes on by itself once a delete has made room or the budget is
raised (`eagle3 budget`). Just before its commit the reservation becomes the shard's measured bytes (a projection
can fall a little short); a shard that then no longer fits pauses the same way, its written files kept, uncounted,
for its next run to reuse. So the counted bytes never pass a budget. A reservation ends when its shard is counted
(or fails); one whose worker died expires after the visibility timeout, and the shard's next run replaces it anyway.

Both budgets can be changed while jobs run: the store-wide one in `eagle3:storage-budget` (over the setting), a job's
in its progress hash (over its job.json). Redis lost without persistence falls back to the setting and job.json.
"""

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import redis

from shared.errors import Eagle3Error, OverBudget, OverStorageBudget
from shared.lifecycle import progress
from shared.lifecycle.schemas import JobRecord
from shared.redis_replies import text
from shared.settings import Settings
from shared.sizes import human_bytes
from shared.storage.objects import Storage

logger = logging.getLogger(__name__)

BUDGET_KEY = "eagle3:storage-budget"  # the store-wide budget set while running, in bytes
# A budget set to unlimited while running; a number, since the job's hash holds numbers (progress reads them so).
UNLIMITED = -1
RESERVATIONS = "eagle3:budget:reservations"  # sorted set: "{job_id}|{shard}" -> expiry (Redis server time)
RESERVED = "eagle3:budget:reserved"  # hash: "{job_id}|{shard}" -> bytes
# Bytes in the store besides the jobs' committed samples, as last measured (`measure_other_bytes`).
OTHER_BYTES_KEY = "eagle3:budget:other-bytes"

# KEYS: reservations, reserved bytes, the job's hash, the other bytes, every job's committed bytes. ARGV: reservation,
# bytes, ttl, store-wide budget and job budget (-1: none), the job's reservation prefix. Returns {1}, {0, which,
# stored, reserved} for the budget that would be crossed, or {-1} where Redis keeps no total yet (nothing changed).
_RESERVE = """
if redis.call('EXISTS', KEYS[5]) == 0 then return {-1} end
local t = redis.call('TIME')
local now = tonumber(t[1])
for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)) do
  redis.call('HDEL', KEYS[2], member)
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
-- another run of this shard (a retry, a redelivery) replaces its reservation
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
local reserved, job_reserved = 0, 0
local all = redis.call('HGETALL', KEYS[2])
for i = 1, #all, 2 do
  local bytes = tonumber(all[i + 1])
  reserved = reserved + bytes
  if string.sub(all[i], 1, #ARGV[6]) == ARGV[6] then job_reserved = job_reserved + bytes end
end
local stored = tonumber(redis.call('GET', KEYS[4]) or '0') + tonumber(redis.call('GET', KEYS[5]) or '0')
local job_stored = tonumber(redis.call('HGET', KEYS[3], 'bytes_stored') or '0')
local wanted = tonumber(ARGV[2])
if tonumber(ARGV[4]) >= 0 and stored + reserved + wanted > tonumber(ARGV[4]) then
  return {0, 'store', stored, reserved}
end
if tonumber(ARGV[5]) >= 0 and job_stored + job_reserved + wanted > tonumber(ARGV[5]) then
  return {0, 'job', job_stored, job_reserved}
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], wanted)
return {1}
"""


def store_budget(client: redis.Redis, settings: Settings) -> int | None:
    """The store-wide budget: the one set while running, else EAGLE3_STORAGE_BUDGET_BYTES; None is unlimited."""
    value = client.get(BUDGET_KEY)
    if value is None:
        return settings.storage_budget_bytes
    return None if int(value) == UNLIMITED else int(value)


def job_budget(client: redis.Redis, job: JobRecord) -> int | None:
    """A job's own budget: the one set while running, else its job.json's; None is unlimited."""
    value = client.hget(progress.job_key(job.job_id), progress.STORAGE_BUDGET)
    if value is None:
        return job.spec.storage_budget_bytes
    return None if int(value) == UNLIMITED else int(value)


def set_store_budget(client: redis.Redis, budget_bytes: int | None) -> None:
    client.set(BUDGET_KEY, UNLIMITED if budget_bytes is None else budget_bytes)


def set_job_budget(client: redis.Redis, job_id: str, budget_bytes: int | None) -> None:
    progress.require_job(client, job_id)
    client.hset(progress.job_key(job_id), progress.STORAGE_BUDGET, UNLIMITED if budget_bytes is None else budget_bytes)


def stored_bytes(client: redis.Redis) -> int:
    """Everything stored, as the budget counts it: every job's committed samples plus the rest of the store as last
    measured."""
    return samples_bytes(client) + other_bytes(client)


def samples_bytes(client: redis.Redis) -> int:
    """Every job's committed samples (the sizes in its manifests), as Redis counts them at each commit."""
    return progress.bytes_stored_total(client)


def other_bytes(client: redis.Redis) -> int:
    """The store's bytes besides the committed samples, as last measured (0 before the first measurement)."""
    return int(client.get(OTHER_BYTES_KEY) or 0)


def measure_other_bytes(client: redis.Redis, storage: Storage) -> int:
    """Measure what the store holds besides the jobs' committed samples: its total size (one listing) less what the
    jobs' manifests count, and keep it for the budget. The producer's upkeep takes it every
    EAGLE3_MAINTENANCE_INTERVAL_S and after each delete, so a checkpoint written in between counts from the next
    measurement. The samples are read after the listing: a running shard's files written but not yet committed count
    here as well as in its reservation until then, which errs on the side of the budget."""
    total = storage.total_size()
    other = max(0, total - progress.recount_bytes_stored(client))  # recounted: the kept total cannot drift for long
    client.set(OTHER_BYTES_KEY, other)
    return other


def remeasure(client: redis.Redis, storage: Storage) -> None:
    """`measure_other_bytes` where nothing waits on it (after a delete has answered): a store or Redis that fails
    meanwhile is logged, and the upkeep's next round measures again."""
    try:
        measure_other_bytes(client, storage)
    except (Eagle3Error, redis.RedisError) as exc:
        logger.warning("cannot measure the store for the storage budget, the next upkeep round will: %s", exc)


def check_submit(
    client: redis.Redis, settings: Settings, job_id: str, projected_bytes: int, budget: int | None
) -> None:
    """A job whose projection does not fit beside what is stored, or in its own budget, is refused up front."""
    store = store_budget(client, settings)
    stored = stored_bytes(client) if store is not None else 0
    if store is not None and stored + projected_bytes > store:
        raise OverBudget(
            f"job {job_id} would store about {projected_bytes / 1e9:.2f} GB but the storage budget is "
            f"{store / 1e9:.2f} GB (EAGLE3_STORAGE_BUDGET_BYTES or `eagle3 budget`) and {stored / 1e9:.2f} GB is "
            "stored already: delete jobs (`eagle3 delete`) or raise the budget"
        )
    if budget is not None and projected_bytes > budget:
        raise OverBudget(
            f"job {job_id} would store about {projected_bytes / 1e9:.2f} GB but its storage_budget_bytes is "
            f"{budget / 1e9:.2f} GB"
        )


def shard_bytes(job: JobRecord, num_samples: int, num_tokens: int) -> int:
    """A shard's share of its job's projected bytes: by tokens, or by samples for a kind that counts none up front."""
    if num_tokens and job.tokens_total:
        return math.ceil(job.projected_bytes * num_tokens / job.tokens_total)
    return math.ceil(job.projected_bytes * num_samples / max(job.samples_total, 1))


def reservation(job_id: str, shard_index: int) -> str:
    return f"{_prefix(job_id)}{shard_index}"


def _prefix(job_id: str) -> str:
    return f"{job_id}|"  # a job id has no "|" (shared/access.py), so no job's prefix is another's


def reserve(client: redis.Redis, settings: Settings, job: JobRecord, shard_index: int, nbytes: int) -> bool:
    """Reserve a shard's bytes before it writes; False when no budget applies (nothing reserved). Raises
    OverStorageBudget, naming the job, the budget and what fills it, when the shard does not fit."""
    store, own = store_budget(client, settings), job_budget(client, job)
    if store is None and own is None:
        return False
    keys = (RESERVATIONS, RESERVED, progress.job_key(job.job_id), OTHER_BYTES_KEY, progress.BYTES_STORED_TOTAL)
    args = (
        reservation(job.job_id, shard_index),
        nbytes,
        math.ceil(settings.visibility_timeout_s),  # the longest a shard may run
        -1 if store is None else store,
        -1 if own is None else own,
        _prefix(job.job_id),
    )
    reply = client.eval(_RESERVE, len(keys), *keys, *args)
    if reply[0] == -1:  # a Redis without the kept total (new, or from before it was kept): recounted, asked again
        progress.recount_bytes_stored(client)
        reply = client.eval(_RESERVE, len(keys), *keys, *args)
    if reply[0] == 1:
        return True
    which, stored, reserved = reply[1].decode(), int(reply[2]), int(reply[3])
    budget, name = (store, "storage budget (EAGLE3_STORAGE_BUDGET_BYTES)") if which == "store" else (own, "job budget")
    assert budget is not None  # only a budget that applies is crossed
    scope = "stored in all" if which == "store" else "stored by the job"
    raise OverStorageBudget(
        f"job {job.job_id} shard {shard_index} needs about {human_bytes(nbytes)}, over the {name} of "
        f"{human_bytes(budget)}: {human_bytes(stored)} {scope}, {human_bytes(reserved)} reserved by running shards; "
        "it goes on once a delete makes room or the budget is raised (`eagle3 budget`)"
    )


@dataclass
class Reservation:
    """A running shard's reservation (`held` False when no budget applied as it started)."""

    client: redis.Redis
    settings: Settings
    job: JobRecord
    shard_index: int
    held: bool

    def settle(self, nbytes: int) -> None:
        """Before the commit: the reservation becomes the shard's measured bytes, which may exceed its projection; a
        shard that no longer fits raises OverStorageBudget and commits nothing (its files wait for the next run)."""
        if self.held:
            reserve(self.client, self.settings, self.job, self.shard_index, nbytes)


@contextmanager
def reserved(
    client: redis.Redis, settings: Settings, job: JobRecord, shard_index: int, nbytes: int
) -> Iterator[Reservation]:
    """A shard's run inside its reservation (when a budget applies), released once it is counted or has failed."""
    held = reserve(client, settings, job, shard_index, nbytes)
    try:
        yield Reservation(client, settings, job, shard_index, held)
    finally:
        if held:
            try:
                release(client, job.job_id, shard_index)
            except redis.RedisError as exc:  # the shard's own outcome matters more; its next run replaces it
                logger.warning(
                    "cannot release the budget reservation of job %s shard %d: %s", job.job_id, shard_index, exc
                )


def release(client: redis.Redis, job_id: str, shard_index: int) -> None:
    member = reservation(job_id, shard_index)
    with client.pipeline() as pipe:
        pipe.zrem(RESERVATIONS, member)
        pipe.hdel(RESERVED, member)
        pipe.execute()


def forget_job(client: redis.Redis, job_id: str) -> None:
    """Drop every reservation of a job (it is being deleted)."""
    mine = [m for m in map(text, client.hkeys(RESERVED)) if m.startswith(_prefix(job_id))]
    if mine:
        with client.pipeline() as pipe:
            pipe.zrem(RESERVATIONS, *mine)
            pipe.hdel(RESERVED, *mine)
            pipe.execute()
