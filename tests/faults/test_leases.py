"""Lease logic against a real Redis (cheap: part of `make test`); the worker kills over real processes are in
test_workers.py."""

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery
from kombu import Connection

from shared.lifecycle import leases, progress
from shared.lifecycle.queue import SHARD_QUEUE, UNACKED, UNACKED_INDEX, Delivery, task_name
from shared.redis_replies import text
from shared.storage import layout
from shared.storage.objects import open_storage


def lease(shard_index: int = 3, holder: str = "host:1:aa", tag: str = "tag-1") -> leases.Lease:
    return leases.Lease(
        task="eagle3.extract_shard",
        task_id=f"job-a:shard:{shard_index:06d}",
        job_id="job-a",
        shard_index=shard_index,
        holder=holder,
        delivery_tag=tag,
    )


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


def wait_expired(client: redis.Redis, limit_s: float = 5) -> list[leases.ExpiredLease]:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        claimed = leases.claim_expired(client)
        if claimed:
            return claimed
        time.sleep(0.05)
    raise TimeoutError("no lease expired")


def test_a_renewed_lease_does_not_expire_and_a_released_one_is_gone(client: redis.Redis) -> None:
    leases.acquire(client, lease(), lease_s=0.5)
    for _ in range(4):
        time.sleep(0.2)
        assert leases.renew(client, "host:1:aa", [lease()], lease_s=0.5) == 1
        assert leases.claim_expired(client) == []
    assert [h.shard_index for h in leases.held(client)] == [3]
    assert leases.release(client, lease())
    assert leases.held(client) == [] and leases.claim_expired(client) == []


def test_an_unrenewed_lease_is_claimed_once(client: redis.Redis) -> None:
    leases.acquire(client, lease(), lease_s=0.2)
    claimed = wait_expired(client)
    assert [c.lease.shard_index for c in claimed] == [3] and claimed[0].lease.holder == "host:1:aa"
    assert leases.claim_expired(client) == []  # a second reaper gets nothing
    assert leases.renew(client, "host:1:aa", [lease()], lease_s=60) == 0  # the late holder no longer owns it


def test_a_newer_delivery_owns_the_lease(client: redis.Redis) -> None:
    leases.acquire(client, lease(holder="old:1:aa", tag="t1"), lease_s=60)
    leases.acquire(client, lease(holder="new:2:bb", tag="t2"), lease_s=60)
    assert not leases.release(client, lease(holder="old:1:aa", tag="t1"))  # the old holder cannot drop it
    assert leases.renew(client, "old:1:aa", [lease(holder="old:1:aa", tag="t1")], lease_s=60) == 0
    assert [h.holder for h in leases.held(client)] == ["new:2:bb"]


def test_a_handed_back_lease_expires_now_unless_a_newer_delivery_owns_it(client: redis.Redis) -> None:
    leases.acquire(client, lease(holder="old:1:aa", tag="t1"), lease_s=60)
    leases.acquire(client, lease(holder="new:2:bb", tag="t2"), lease_s=60)
    assert not leases.hand_back(client, lease(holder="old:1:aa", tag="t1"))  # a stale run cannot expire it
    assert leases.claim_expired(client) == []
    assert leases.hand_back(client, lease(holder="new:2:bb", tag="t2"))
    assert [c.lease.holder for c in leases.claim_expired(client)] == ["new:2:bb"]  # at once, not in 60 s


def test_reap_requeues_only_unfinished_shards_and_counts_reruns(client: redis.Redis, tmp_path: Path) -> None:
    storage = open_storage(tmp_path.as_uri())
    storage.put(layout.job_json("job-a"), b"{}")
    client.hset(progress.job_key("job-a"), mapping={"shards_total": 3})
    storage.put(layout.manifest("job-a", 1), b"{}")  # shard 1 is committed and counted: its lease expiring changes
    client.sadd(progress.committed_key("job-a"), 1)  # nothing
    for shard_index in (0, 1, 2):
        leases.acquire(client, lease(shard_index, tag=f"t{shard_index}"), lease_s=0.1)
    time.sleep(0.3)
    in_broker = {"t0"}  # shard 0's message is still unacknowledged in the broker; shard 2's was lost
    restored, resent = [], []

    def restore(lease: leases.Lease) -> bool:
        restored.append(lease.shard_index)
        return lease.delivery_tag in in_broker

    requeued = leases.reap(client, storage, restore=restore, resend=lambda lease: resent.append(lease.shard_index))
    assert sorted(e.lease.shard_index for e in requeued) == [0, 2]
    assert sorted(restored) == [0, 1, 2] and resent == [2]
    assert client.hget(progress.job_key("job-a"), leases.RERUN_FIELD) == b"2"
    assert leases.held(client) == []


def test_a_shard_committed_while_redis_was_away_is_sent_again_to_be_counted(
    client: redis.Redis, tmp_path: Path
) -> None:
    """Its manifest landed, Redis was down longer than the worker waits, the worker gave its message up: the reaper
    sends it again (a run of a committed shard only counts it); counted, or with its message restored, it does not."""
    storage = open_storage(tmp_path.as_uri())
    storage.put(layout.job_json("job-a"), b"{}")
    for shard_index in (0, 1, 2):
        storage.put(layout.manifest("job-a", shard_index), b"{}")
        leases.acquire(client, lease(shard_index, tag=f"t{shard_index}"), lease_s=0.1)
    client.sadd(progress.committed_key("job-a"), 1)
    time.sleep(0.3)
    resent: list[int] = []
    requeued = leases.reap(
        client,
        storage,
        restore=lambda lease: lease.delivery_tag == "t2",
        resend=lambda lease: resent.append(lease.shard_index),
    )
    assert requeued == [] and resent == [0]  # 1 is counted; 2's message went back to the queue, which counts it
    assert client.hget(progress.job_key("job-a"), leases.RERUN_FIELD) is None


def test_the_shards_of_a_deleted_job_are_not_sent_again(client: redis.Redis, tmp_path: Path) -> None:
    storage = open_storage(tmp_path.as_uri())  # no job.json: the job was deleted while its shards waited
    leases.acquire(client, lease(0, tag="t0"), lease_s=0.1)
    time.sleep(0.3)
    resent: list[int] = []
    assert leases.reap(client, storage, restore=lambda lease: False, resend=lambda lease: resent.append(0)) == []
    assert resent == [] and leases.held(client) == []


def test_a_failed_reap_puts_the_lease_back(client: redis.Redis, tmp_path: Path) -> None:
    storage = open_storage(tmp_path.as_uri())
    leases.acquire(client, lease(), lease_s=0.05)
    time.sleep(0.2)

    def broken_broker(lease: leases.Lease) -> bool:
        raise redis.ConnectionError("broker down")

    with pytest.raises(redis.ConnectionError):
        leases.reap(client, storage, restore=broken_broker, resend=lambda lease: None)
    assert [c.lease.shard_index for c in wait_expired(client)] == [3]  # the next reaper gets it again


def test_a_job_redis_lost_is_not_half_recreated_by_a_rerun(client: redis.Redis) -> None:
    leases.count_rerun(client, "job-gone")
    assert not client.exists(progress.job_key("job-gone"))


class Broker:
    """Shard messages sent and received through kombu's Redis transport, as the workers do: each received message is
    recorded as delivered (kombu's `unacked` hash) and left unacknowledged."""

    def __init__(self, redis_url: str) -> None:
        self.sender = Celery(broker=redis_url, set_as_current=False)
        self.connection = Connection(redis_url)
        self.channel = self.connection.default_channel

    def deliver(self, job_id: str, shard_index: int, *, age_s: float) -> str:
        """A shard message received `age_s` ago; returns its delivery tag."""
        self.sender.send_task(
            task_name("extract"), args=[job_id, shard_index], queue=SHARD_QUEUE, task_id=f"{job_id}:{shard_index}"
        )
        message = self.channel.basic_get(SHARD_QUEUE, no_ack=False)
        assert message is not None
        self.channel.client.zadd(UNACKED_INDEX, {message.delivery_tag: time.time() - age_s})
        return str(message.delivery_tag)

    def restore(self, delivery: Delivery) -> bool:
        if not self.channel.client.hexists(UNACKED, delivery.delivery_tag):
            return False
        self.channel.qos.restore_by_tag(delivery.delivery_tag)
        return True

    def queued(self) -> list[str]:
        return sorted(json.loads(raw)["headers"]["id"] for raw in self.channel.client.lrange(SHARD_QUEUE, 0, -1))

    def close(self) -> None:
        self.sender.close()
        self.connection.close()


@pytest.fixture
def broker(redis_url: str) -> Iterator[Broker]:
    broker = Broker(redis_url)
    yield broker
    broker.close()


def test_a_delivery_without_a_lease_goes_back_to_the_queue_once_a_lease_period_old(
    client: redis.Redis, broker: Broker, tmp_path: Path
) -> None:
    """The broker holds messages as delivered whose shard has no lease (Redis killed between a delivery and its lease):
    an unfinished shard's goes back to the queue, once; a shard another delivery leases, or a delivery younger than a
    lease period, is left alone; a finished shard's message and a deleted job's are removed, nothing run again."""
    storage = open_storage(tmp_path.as_uri())
    storage.put(layout.job_json("job-a"), b"{}")
    client.hset(progress.job_key("job-a"), mapping={"shards_total": 6})
    stranded = broker.deliver("job-a", 0, age_s=120)
    young = broker.deliver("job-a", 1, age_s=5)  # its worker is taking the lease
    leased_elsewhere = broker.deliver("job-a", 2, age_s=120)
    leases.acquire(client, lease(2, holder="other:2:bb", tag="newer-delivery"), lease_s=60)
    broker.deliver("job-a", 3, age_s=120)
    storage.put(layout.manifest("job-a", 3), b"{}")  # committed and counted
    client.sadd(progress.committed_key("job-a"), 3)
    broker.deliver("job-a", 4, age_s=120)
    storage.put(layout.manifest("job-a", 4), b"{}")  # committed, never counted: its run only counts it
    broker.deliver("job-a", 5, age_s=120)
    storage.put(layout.dead_letter("job-a", 5), b"{}")
    broker.deliver("job-deleted", 0, age_s=120)  # no job.json

    restored = leases.return_unleased(client, storage, older_than_s=60, every_s=15, restore=broker.restore)

    assert sorted(d.shard_index for d in restored) == [0, 4] and restored[0].delivery_tag == stranded
    assert broker.queued() == ["job-a:0", "job-a:4"]
    assert {text(tag) for tag in client.hkeys(UNACKED)} == {young, leased_elsewhere}
    assert [h.delivery_tag for h in leases.held(client)] == ["newer-delivery"]  # untouched
    assert client.hget(progress.job_key("job-a"), leases.RERUN_FIELD) == b"2"
    # One reaper of the fleet sweeps an interval; the next sweep finds nothing more to return.
    assert leases.return_unleased(client, storage, older_than_s=60, every_s=15, restore=broker.restore) == []
    client.delete(leases.UNLEASED_SWEEP)
    assert leases.return_unleased(client, storage, older_than_s=60, every_s=15, restore=broker.restore) == []
    assert broker.queued() == ["job-a:0", "job-a:4"]
