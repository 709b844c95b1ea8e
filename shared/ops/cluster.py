"""What the cluster is doing right now: live workers (with the shards each holds and its last heartbeat) and the
depth of the shard queue (with the age of its oldest message), read from Redis by the API, the dashboard and /metrics.

Workers announce themselves: a worker's consumer beats every `worker_heartbeat_interval_s` into
`eagle3:worker:{name}`, and each task it starts or finishes adds or removes a `task:{task_id}` field there. A worker
killed outright stops beating but keeps its last holdings, so the dashboard shows which shards a dead worker held
until the visibility timeout puts them back in the queue.
"""

import json
import logging
import time

import redis
from pydantic import BaseModel

from shared.lifecycle import progress
from shared.lifecycle.queue import SENT_TS_HEADER, SHARD_QUEUE, UNACKED, queue_lists
from shared.redis_replies import scored_members, text, text_hash

logger = logging.getLogger(__name__)

WORKERS_INDEX = "eagle3:workers"  # sorted set: worker name -> time of its last heartbeat
WORKER_RETENTION_S = 24 * 3600  # a worker silent for longer is forgotten


def worker_key(name: str) -> str:
    return f"eagle3:worker:{name}"


class HeldShard(BaseModel):
    task_id: str
    task: str
    job_id: str
    shard_index: int
    started_ts: float


class WorkerStatus(BaseModel):
    name: str
    alive: bool  # beat within the last `stale_after_s`
    started_ts: float
    last_heartbeat_ts: float
    seconds_since_heartbeat: float
    concurrency: int
    holding: list[HeldShard]


class QueueDepth(BaseModel):
    queue: str
    depth: int  # messages waiting, all priorities
    oldest_age_s: float | None  # age of the message that waited longest; None when the queue is empty
    in_flight: int  # delivered to a worker and not acknowledged yet (kombu's unacked set, every queue)


# ---------------------------------------------------------------------------------------------------------------------
# Written by workers


def beat(client: redis.Redis, name: str, *, concurrency: int, now: float | None = None) -> None:
    now = time.time() if now is None else now
    key = worker_key(name)
    with client.pipeline() as pipe:
        pipe.hsetnx(key, "started_ts", now)
        pipe.hset(key, mapping={"last_heartbeat_ts": now, "concurrency": concurrency})
        pipe.expire(key, WORKER_RETENTION_S)
        pipe.zadd(WORKERS_INDEX, {name: now})
        pipe.zremrangebyscore(WORKERS_INDEX, "-inf", now - WORKER_RETENTION_S)
        pipe.execute()


def hold(client: redis.Redis, name: str, shard: HeldShard) -> None:
    client.hset(worker_key(name), f"task:{shard.task_id}", shard.model_dump_json())


def release(client: redis.Redis, name: str, task_id: str) -> None:
    client.hdel(worker_key(name), f"task:{task_id}")


def leave(client: redis.Redis, name: str) -> None:
    """A worker that stops cleanly disappears from the list at once."""
    with client.pipeline() as pipe:
        pipe.delete(worker_key(name))
        pipe.zrem(WORKERS_INDEX, name)
        pipe.execute()


# ---------------------------------------------------------------------------------------------------------------------
# Read by the API, the dashboard and /metrics


def list_workers(client: redis.Redis, *, stale_after_s: float, now: float | None = None) -> list[WorkerStatus]:
    """Every worker seen in the last day, most recently heard from first."""
    now = time.time() if now is None else now
    workers = []
    for raw_name, _ in scored_members(client.zrevrange(WORKERS_INDEX, 0, -1, withscores=True)):
        name = text(raw_name)
        fields = text_hash(client.hgetall(worker_key(name)))
        if "last_heartbeat_ts" not in fields:
            continue  # expired between the two reads
        last = float(fields["last_heartbeat_ts"])
        holding = [HeldShard.model_validate_json(v) for k, v in fields.items() if k.startswith("task:")]
        workers.append(
            WorkerStatus(
                name=name,
                alive=now - last <= stale_after_s,
                started_ts=float(fields.get("started_ts", last)),
                last_heartbeat_ts=last,
                seconds_since_heartbeat=max(now - last, 0.0),
                concurrency=int(fields.get("concurrency", 1)),
                holding=sorted(holding, key=lambda h: h.started_ts),
            )
        )
    return workers


def queue_depth(client: redis.Redis, queue: str = SHARD_QUEUE, *, now: float | None = None) -> QueueDepth:
    now = time.time() if now is None else now
    names = queue_lists(queue)
    with client.pipeline() as pipe:
        for name in names:
            pipe.llen(name)
        for name in names:
            pipe.lindex(name, -1)  # kombu pushes on the left and pops on the right: the tail waited longest
        pipe.hlen(UNACKED)
        replies = pipe.execute()
    depths, tails, in_flight = replies[: len(names)], replies[len(names) : 2 * len(names)], replies[-1]
    sent = [ts for ts in (_sent_ts(client, tail) for tail in tails if tail is not None) if ts is not None]
    return QueueDepth(
        queue=queue,
        depth=sum(depths),
        oldest_age_s=max(now - min(sent), 0.0) if sent else None,
        in_flight=in_flight,
    )


def _sent_ts(client: redis.Redis, message: bytes) -> float | None:
    """When a queued message was published: its header, else (a message from an older producer) its job's creation."""
    try:
        headers = json.loads(message).get("headers", {})
    except (ValueError, AttributeError):
        logger.warning("queue message is not kombu JSON; its age is unknown")
        return None
    if SENT_TS_HEADER in headers:
        return float(headers[SENT_TS_HEADER])
    job_id = str(headers.get("id", "")).split(":", 1)[0]
    return progress.created_ts(client, job_id) if job_id else None
