"""Recovery against a real Redis and real file storage: a producer that died while enqueueing, and Redis that lost
its state. The same over real processes (a killed producer, a Redis restarted empty) is in the fault suite."""

import json
import time
from pathlib import Path

import pytest
import redis

from shared.lifecycle import deletion, jobs, leases, progress, recovery
from shared.lifecycle.kinds import EXTRACT
from shared.lifecycle.queue import SHARD_QUEUE, UNACKED, ShardSender, messages_in_broker, task_id
from shared.lifecycle.schemas import DeadLetter, JobRecord
from shared.storage import layout
from shared.storage.objects import Storage, open_storage
from tests.integration.test_progress import make_job, make_manifest


class Died(Exception):
    """The producer, killed between two enqueues."""


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


@pytest.fixture
def storage(tmp_path: Path) -> Storage:
    return open_storage(tmp_path.as_uri())


def published(storage: Storage, client: redis.Redis, job: JobRecord) -> None:
    """What submit leaves: the index entry, job.json, the job registered."""
    recovery.index_job(storage, job.job_id)
    storage.put(layout.job_json(job.job_id), job.model_dump_json().encode())
    progress.register_job(client, job, storage.url, EXTRACT)


def test_a_stalled_enqueueing_is_finished_by_a_reaper(client: redis.Redis, storage: Storage) -> None:
    job = make_job(shards=5)
    published(storage, client, job)
    sent: list[int] = []

    def dies_after_two(kind: str, job_id: str, shard_index: int) -> None:
        if len(sent) == 2:
            raise Died
        sent.append(shard_index)

    with pytest.raises(Died):
        recovery.publish(storage, client, job, enqueue=dies_after_two)
    assert client.hget(progress.job_key("job-a"), progress.SHARDS_ENQUEUED) == b"2"
    # Not stalled yet for a reaper that waits a lease period.
    assert recovery.take_over_stalled_publishing(storage, client, enqueue=dies_after_two, stalled_after_s=60) == []

    rest: list[int] = []
    taken = recovery.take_over_stalled_publishing(
        storage, client, enqueue=lambda kind, job_id, k: rest.append(k), stalled_after_s=0
    )
    assert taken == ["job-a"] and sent + rest == [0, 1, 2, 3, 4]
    assert client.hget(progress.job_key("job-a"), progress.SHARDS_ENQUEUED) == b"5"
    assert not client.zscore(recovery.PUBLISHING, "job-a")  # finished: no reaper takes it again
    assert recovery.take_over_stalled_publishing(storage, client, enqueue=rest.append, stalled_after_s=0) == []


@pytest.mark.parametrize("cancelled", [False, True])
def test_a_submit_that_stopped_before_registering_the_job_is_finished_by_a_reaper(
    client: redis.Redis, storage: Storage, monkeypatch: pytest.MonkeyPatch, cancelled: bool
) -> None:
    """job.json written, then the producer lost Redis (or was killed) before the job's registration: Redis does not
    know the job, and a submit of the same id is refused (it exists). The publishing entered before job.json lets a
    reaper register the job and publish it whole; a job cancelled meanwhile is registered cancelled."""
    job = make_job(shards=3)
    storage.put(layout.manifest("job-a", 1), make_manifest(1).model_dump_json().encode())  # a shard run twice

    def redis_went_down(*args: object) -> None:
        raise redis.ConnectionError("Connection refused")

    with monkeypatch.context() as patched:
        patched.setattr(progress, "register_job", redis_went_down)
        with pytest.raises(redis.ConnectionError):
            jobs.publish_job(storage, client, job, enqueue=lambda *a: pytest.fail("not registered: no enqueue"))
    assert storage.exists(layout.job_json("job-a")) and not client.exists(progress.job_key("job-a"))
    if cancelled:
        storage.put(layout.cancelled("job-a"), b"")
    # Not stalled yet for a reaper that waits a lease period.
    assert recovery.take_over_stalled_publishing(storage, client, enqueue=Died, stalled_after_s=60) == []

    sent: list[int] = []
    taken = recovery.take_over_stalled_publishing(
        storage, client, enqueue=lambda kind, job_id, k: sent.append(k), stalled_after_s=0
    )
    assert taken == ["job-a"] and sent == ([] if cancelled else [0, 2])
    state = progress.job_progress(client, "job-a")
    assert (state.state, state.shards_committed) == ("cancelled" if cancelled else "running", 1)
    assert not client.zscore(recovery.PUBLISHING, "job-a")  # finished: no reaper takes it again
    assert recovery.take_over_stalled_publishing(storage, client, enqueue=Died, stalled_after_s=0) == []


def test_a_submit_that_died_before_job_json_leaves_no_publishing(client: redis.Redis, storage: Storage) -> None:
    recovery.index_job(storage, "job-a")
    recovery.begin_publishing(client, "job-a")
    assert recovery.take_over_stalled_publishing(storage, client, enqueue=Died, stalled_after_s=0) == []
    assert not client.zscore(recovery.PUBLISHING, "job-a") and not client.exists(progress.job_key("job-a"))


def test_redis_lost_jobs_are_recovered_from_storage_once(client: redis.Redis, storage: Storage) -> None:
    running, cancelled = make_job(shards=4), make_job(shards=2).model_copy(update={"job_id": "job-b"})
    for job in (running, cancelled):
        published(storage, client, job)
    storage.put(layout.manifest("job-a", 0), make_manifest(0).model_dump_json().encode())
    letter = DeadLetter(job_id="job-a", shard_index=2, error_type="E", reason="r", retries=5, worker="w")
    storage.put(layout.dead_letter("job-a", 2), letter.model_dump_json().encode())
    storage.put(layout.shard_input("job-a", 2), b'{"job_id": "job-a", "shard_index": 2, "samples": []}')
    storage.put(layout.cancelled("job-b"), b"")
    recovery.index_job(storage, "job-never-planned")  # its submit died before job.json
    sent: list[tuple[str, int]] = []

    def enqueue(kind: str, job_id: str, shard_index: int) -> None:
        sent.append((job_id, shard_index))

    first, second = recovery.RedisState("w1"), recovery.RedisState("w2")
    first.adopt(client)  # both workers start with this Redis
    second.adopt(client)
    assert first.check(storage, client, enqueue=enqueue) == [] and sent == []  # nothing lost
    client.flushdb()  # Redis lost everything
    assert first.check(storage, client, enqueue=enqueue) == ["job-a", "job-b"]
    # Committed shard 0 and dead-lettered shard 2 are not run again; cancelled job-b not at all.
    assert sent == [("job-a", 1), ("job-a", 3)]
    a, b = progress.job_progress(client, "job-a"), progress.job_progress(client, "job-b")
    assert (a.state, a.shards_committed, a.tokens_done, a.shards_dead_lettered) == ("running", 1, 100, 1)
    assert b.state == "cancelled"
    assert second.check(storage, client, enqueue=enqueue) == []  # w1 did it: w2 only moves on
    assert first.check(storage, client, enqueue=enqueue) == [] and len(sent) == 2


def test_a_new_redis_is_not_taken_for_a_lost_one(client: redis.Redis, storage: Storage) -> None:
    """Workers that start on an empty Redis (a new deployment, `make demo`) leave storage's old jobs alone."""
    published(storage, client, make_job())
    client.flushdb()
    state = recovery.RedisState("w1")
    state.adopt(client)
    assert state.check(storage, client, enqueue=lambda *a: pytest.fail("nothing to enqueue")) == []
    assert not client.exists(progress.job_key("job-a"))


def test_a_recovery_under_way_is_not_repeated_by_another_worker(client: redis.Redis, storage: Storage) -> None:
    published(storage, client, make_job())
    state = recovery.RedisState("w2")
    state.adopt(client)
    client.flushdb()
    client.set(recovery.RECOVERY_LOCK, "w1", ex=60)  # w1 is recovering
    assert state.check(storage, client, enqueue=lambda *a: pytest.fail("w1 enqueues")) == []
    assert state.epoch != client.get(recovery.STATE_MARKER).decode()  # w2 looks again until w1 is done


def test_a_resume_that_died_half_way_is_finished_by_a_reaper_and_loses_no_dead_letter(
    client: redis.Redis, storage: Storage
) -> None:
    """A resume enqueues through the same checkpoints as a submit: the producer killed after two shards leaves the
    rest to the reaper, and a dead-lettered shard it had not reached stays dead-lettered (and counted) till then."""
    job = make_job(shards=5)
    published(storage, client, job)
    for shard_index in (1, 3):  # dead-lettered earlier
        letter = DeadLetter(job_id="job-a", shard_index=shard_index, error_type="X", reason="r", retries=3, worker="w")
        storage.put(layout.dead_letter("job-a", shard_index), letter.model_dump_json().encode())
    sent: list[int] = []

    def dies_after_two(kind: str, job_id: str, shard_index: int) -> None:
        if len(sent) == 2:
            raise Died
        sent.append(shard_index)

    with pytest.raises(Died):
        jobs.resume("job-a", storage=storage, client=client, enqueue=dies_after_two)
    assert sent == [0, 1] and not storage.exists(layout.dead_letter("job-a", 1))
    assert storage.exists(layout.dead_letter("job-a", 3))  # not reached: still dead-lettered, still counted
    assert progress.job_progress(client, "job-a").shards_dead_lettered == 1

    rest: list[int] = []
    taken = recovery.take_over_stalled_publishing(
        storage, client, enqueue=lambda kind, job_id, k: rest.append(k), stalled_after_s=0
    )
    assert taken == ["job-a"] and rest == [2, 4]  # shard 3 waits, visibly dead-lettered, for the next resume


def test_a_shard_whose_message_the_broker_lost_is_sent_again_once_its_job_is_quiet(
    client: redis.Redis, storage: Storage, redis_url: str
) -> None:
    """Of a job's six shards: one committed, one dead-lettered, one waiting in the queue, one delivered to a worker
    (kombu's unacknowledged hash), one committed in storage but not yet counted (its worker died after the commit),
    and one whose message is nowhere (popped by a worker whose connection died with Redis before the reply came).
    Once the job has been quiet for the period, only that one is sent again, and once a period."""
    job = make_job(shards=6)
    published(storage, client, job)
    sender = ShardSender(redis_url)
    for shard_index in (2, 3):
        sender.send("extract", "job-a", shard_index)
    # Shard 2 delivered: kombu moves a popped message into its unacked hash as [message, exchange, routing key].
    delivered = client.rpop(SHARD_QUEUE)
    assert delivered is not None and json.loads(delivered)["headers"]["id"] == task_id("extract", "job-a", 2)
    client.hset(UNACKED, "tag-2", json.dumps([json.loads(delivered), "", SHARD_QUEUE]))
    manifest = make_manifest(0)
    storage.put(layout.manifest("job-a", 0), manifest.model_dump_json().encode())
    progress.record_commit(client, manifest)
    letter = DeadLetter(job_id="job-a", shard_index=1, error_type="E", reason="r", retries=5, worker="w")
    storage.put(layout.dead_letter("job-a", 1), letter.model_dump_json().encode())
    storage.put(layout.manifest("job-a", 4), make_manifest(4).model_dump_json().encode())
    sent: list[tuple[str, str, int]] = []

    def enqueue(kind: str, job_id: str, shard_index: int) -> None:
        sent.append((kind, job_id, shard_index))

    def next_look(quiet_for_s: float) -> list[tuple[str, int]]:
        """A reaper's look once the fleet's last look has expired (a quarter period)."""
        client.delete(recovery.LOST_SHARDS_SWEEP)
        return recovery.resend_lost_shards(storage, client, enqueue=enqueue, quiet_for_s=quiet_for_s)

    # A commit a moment ago: the job is not quiet yet.
    assert next_look(60) == []
    time.sleep(0.05)
    # The fleet looked a moment ago: another reaper does not look again before a quarter period.
    assert recovery.resend_lost_shards(storage, client, enqueue=enqueue, quiet_for_s=0.01) == []
    assert next_look(0.01) == [("job-a", 5)]
    assert sent == [("extract", "job-a", 5)]
    assert progress.job_progress(client, "job-a").shards_rerun == 1
    # The job is not looked at again in the same period: the shard's new message may still be on its way.
    assert next_look(0.01) == []


def test_a_reapers_look_at_a_job_leaves_nothing_once_the_job_is_deleted(client: redis.Redis, storage: Storage) -> None:
    """The look's key goes with the job's other keys, and a reaper that read the job before a delete marked it does
    not set the key behind the delete (the chaos soak found one left, under a loaded machine)."""
    published(storage, client, make_job(shards=2))
    time.sleep(0.05)
    assert recovery.resend_lost_shards(storage, client, enqueue=lambda *a: None, quiet_for_s=0.01) == [
        ("job-a", 0),
        ("job-a", 1),
    ]
    assert client.exists(recovery.lost_shards_check_key("job-a"))
    deletion.delete_job("job-a", storage=storage, client=client, cancel=True, wait_s=0)
    assert not client.exists(recovery.lost_shards_check_key("job-a"))

    published(storage, client, make_job(shards=2))
    client.hset(progress.job_key("job-a"), "deleting", 1)  # a delete under way, after the reaper read the job
    assert not recovery.claim_look(client, "job-a", 60)
    assert not client.exists(recovery.lost_shards_check_key("job-a"))
    client.hset(progress.job_key("job-a"), "deleting", 0)
    assert recovery.claim_look(client, "job-a", 60) and not recovery.claim_look(client, "job-a", 60)


@pytest.mark.parametrize("why", ["leased", "cancelled", "publishing"])
def test_a_job_being_worked_on_cancelled_or_published_is_not_looked_at(
    client: redis.Redis, storage: Storage, why: str
) -> None:
    """A job with a leased shard is being worked on (its other messages may be in a worker's memory); a cancelled
    job's shards are not to run; a job still being published has its shards enqueued by its publisher."""
    job = make_job(shards=2)
    published(storage, client, job)
    if why == "leased":
        lease = leases.Lease("eagle3.extract_shard", "t", "job-a", 0, holder="w", delivery_tag="d")
        leases.acquire(client, lease, 60)
    elif why == "cancelled":
        progress.cancel(client, "job-a")
    else:
        recovery.begin_publishing(client, "job-a")
    time.sleep(0.05)
    assert recovery.resend_lost_shards(storage, client, enqueue=lambda *a: pytest.fail(str(a)), quiet_for_s=0.01) == []


def test_a_long_queue_is_not_read_for_lost_shards(
    client: redis.Redis, storage: Storage, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading a long queue would hold a worker's event loop for seconds: its jobs wait until it has drained."""
    job = make_job(shards=3)
    published(storage, client, job)
    sender = ShardSender(redis_url)
    for shard_index in range(2):
        sender.send("extract", "job-a", shard_index)
    assert messages_in_broker(client, limit=1) is None
    assert messages_in_broker(client, limit=2) == {task_id("extract", "job-a", k) for k in range(2)}
    time.sleep(0.05)
    with monkeypatch.context() as patched:
        patched.setattr(recovery, "messages_in_broker", lambda c: messages_in_broker(c, limit=1))
        assert (
            recovery.resend_lost_shards(storage, client, enqueue=lambda *a: pytest.fail(str(a)), quiet_for_s=0.01) == []
        )
    # Not marked as looked at: the next look, once the queue is short enough, finds shard 2 lost.
    client.delete(recovery.LOST_SHARDS_SWEEP)
    sent: list[int] = []
    assert recovery.resend_lost_shards(storage, client, enqueue=lambda k, j, i: sent.append(i), quiet_for_s=0.01) == [
        ("job-a", 2)
    ]
    assert sent == [2]
