"""The shard queue: its name, the task names and ids, the send-only client the producer enqueues with, and what the
broker holds of it (kombu's Redis lists and unacknowledged hash)."""

import base64
import json
import logging
import time
from dataclasses import dataclass

import redis
from celery import Celery

from shared.redis_replies import scored_members, text

logger = logging.getLogger(__name__)

# Every kind's shards travel on one queue, so that every worker takes either and KEDA scales on one list.
SHARD_QUEUE = "eagle3.extract"
# When a shard message was sent: the queue's oldest-message age (shared/ops/cluster.py).
SENT_TS_HEADER = "eagle3_sent_ts"
# kombu's Redis transport keeps one list per priority step (the plain name holds priority 0), and one hash of the
# messages delivered to a worker and not yet acknowledged (every queue's), each value [message, exchange, routing key].
PRIORITY_SUFFIXES = ("", "\x06\x163", "\x06\x166", "\x06\x169")
UNACKED = "unacked"
UNACKED_INDEX = "unacked_index"  # the same delivery tags, scored by when a worker received each (its clock)
SCAN_LIMIT = 20_000  # messages read at most when looking for lost ones (about 25 MB, a second's parsing)


def task_name(kind: str) -> str:
    """The Celery task that runs one shard of a job kind."""
    return f"eagle3.{kind}_shard"


def task_id(kind: str, job_id: str, shard_index: int) -> str:
    # Deterministic, so a task is recognisable in Flower and in logs across redeliveries.
    return f"{job_id}:{kind}:{shard_index:06d}"


class ShardSender:
    """Sends shard tasks by name over the broker. It registers no task and reads no worker setting, so a process that
    only enqueues (the producer) never imports the worker's code."""

    def __init__(self, broker_url: str) -> None:
        self._app = Celery("eagle3-sender", broker=broker_url, set_as_current=False)
        self._app.conf.update(task_send_sent_event=True, broker_connection_retry_on_startup=True)

    def send(self, kind: str, job_id: str, shard_index: int) -> None:
        self._app.send_task(
            task_name(kind),
            args=[job_id, shard_index],
            queue=SHARD_QUEUE,
            task_id=task_id(kind, job_id, shard_index),
            headers={SENT_TS_HEADER: time.time()},
        )


def queue_lists(queue: str = SHARD_QUEUE) -> list[str]:
    """The Redis lists kombu keeps `queue` in, one per priority step."""
    return [queue + suffix for suffix in PRIORITY_SUFFIXES]


def messages_in_broker(client: redis.Redis, queue: str = SHARD_QUEUE, *, limit: int = SCAN_LIMIT) -> set[str] | None:
    """The task ids of every shard message the broker holds: waiting in the queue or delivered and unacknowledged
    (read in one transaction, so that a message moving from one to the other is seen in one of them). None when it
    holds more than `limit`: reading them all would hold up the caller (a worker's event loop) for seconds."""
    names = queue_lists(queue)
    with client.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.llen(name)
        pipe.hlen(UNACKED)
        if sum(pipe.execute()) > limit:
            return None
    with client.pipeline(transaction=True) as pipe:
        for name in names:
            pipe.lrange(name, 0, -1)
        pipe.hvals(UNACKED)
        *queued, unacked = pipe.execute()
    ids: set[str] = set()
    for raw, delivered in [(m, False) for replies in queued for m in replies] + [(m, True) for m in unacked]:
        try:
            message = json.loads(raw)
            ids.add(str((message[0] if delivered else message)["headers"]["id"]))
        except (ValueError, TypeError, IndexError, KeyError):
            logger.warning("a message in the broker is not kombu JSON with a task id: %.100r", raw)
    return ids


@dataclass(frozen=True)
class Delivery:
    """A shard message the broker holds as delivered to a worker and not yet acknowledged."""

    delivery_tag: str
    task: str
    task_id: str
    job_id: str
    shard_index: int
    delivered_at: float  # Unix seconds, by the clock of the worker that received it


def deliveries_before(client: redis.Redis, delivered_before: float, *, limit: int = 1000) -> list[Delivery]:
    """The shard messages delivered before `delivered_before` (Unix seconds) and still unacknowledged, oldest first;
    messages that are not shard tasks are left out."""
    tagged = scored_members(
        client.zrangebyscore(UNACKED_INDEX, "-inf", delivered_before, start=0, num=limit, withscores=True)
    )
    if not tagged:
        return []
    payloads = client.hmget(UNACKED, [tag for tag, _ in tagged])
    deliveries = []
    for (raw_tag, delivered_at), raw in zip(tagged, payloads, strict=True):
        if raw is None:  # acknowledged since
            continue
        try:
            message = json.loads(raw)[0]  # [message, exchange, routing key]
            body = message["body"]
            if message["properties"].get("body_encoding") == "base64":
                body = base64.b64decode(body)
            (job_id, shard_index), _, _ = json.loads(body)  # Celery's protocol 2: [args, kwargs, embed]
            delivery = Delivery(
                delivery_tag=text(raw_tag),
                task=str(message["headers"]["task"]),
                task_id=str(message["headers"]["id"]),
                job_id=str(job_id),
                shard_index=int(shard_index),
                delivered_at=float(delivered_at),
            )
        except (ValueError, TypeError, IndexError, KeyError):
            continue  # not a shard task (another app's message, or not Celery's format)
        deliveries.append(delivery)
    return deliveries


def drop_delivery(client: redis.Redis, delivery_tag: str) -> None:
    """Remove a delivered message from the broker, as kombu's acknowledgement does."""
    with client.pipeline(transaction=True) as pipe:
        pipe.zrem(UNACKED_INDEX, delivery_tag)
        pipe.hdel(UNACKED, delivery_tag)
        pipe.execute()
