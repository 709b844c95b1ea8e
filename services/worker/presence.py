"""What a worker tells the rest of the cluster through Redis: that it is alive (a beat every
`worker_heartbeat_interval_s` from the consumer's event loop), which shards it holds (task start and end), and how
each shard went (latency, bytes, failures by reason) for /metrics and the dashboard. See shared/ops/cluster.py and
shared/lifecycle/shard_metrics.py.

None of this may break a task: a Redis error here is logged and the task goes on.
"""

import logging
import os
import time
from functools import cache
from typing import Any

import redis
from celery import Task, bootsteps, signals

from shared.lifecycle import shard_metrics
from shared.ops import cluster
from shared.settings import get_settings

logger = logging.getLogger(__name__)

_REDIS_TIMEOUT_S = 2.0  # the beat runs on the consumer's event loop: never block it for long


@cache
def _client(pid: int) -> redis.Redis:
    # One client per process: pool children are forked after the main process may have made its own.
    url = get_settings().redis_url
    return redis.Redis.from_url(url, socket_timeout=_REDIS_TIMEOUT_S, socket_connect_timeout=_REDIS_TIMEOUT_S)


def client() -> redis.Redis:
    return _client(os.getpid())


def _task_kind(task_name: str) -> str:
    return task_name.rsplit(".", 1)[-1].removesuffix("_shard")  # eagle3.extract_shard -> extract


class WorkerPresence(bootsteps.StartStopStep):
    """Consumer bootstep: beat into the worker registry while the consumer runs; leave it on a clean stop."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        self.name: str = c.hostname
        self.concurrency: int = c.controller.concurrency
        self.timer_entry: Any = None

    def start(self, c: Any) -> None:
        self.beat()
        self.timer_entry = c.timer.call_repeatedly(get_settings().worker_heartbeat_interval_s, self.beat, priority=10)

    def stop(self, c: Any) -> None:
        if self.timer_entry is not None:
            self.timer_entry.cancel()
            self.timer_entry = None

    def shutdown(self, c: Any) -> None:
        self.stop(c)
        try:
            cluster.leave(client(), self.name)
        except redis.RedisError as exc:
            logger.warning("cannot remove worker %s from the registry: %s", self.name, exc)

    def beat(self) -> None:
        try:
            cluster.beat(client(), self.name, concurrency=self.concurrency)
        except redis.RedisError as exc:
            logger.warning("worker registry beat failed (%s); Celery's reconnect handles the broker", exc)


@signals.task_prerun.connect
def _on_task_prerun(task_id: str, task: Task, args: tuple = (), **kwargs: Any) -> None:
    if len(args) != 2:
        return
    job_id, shard_index = args
    held = cluster.HeldShard(
        task_id=task_id, task=task.name, job_id=job_id, shard_index=shard_index, started_ts=time.time()
    )
    try:
        cluster.hold(client(), task.request.hostname, held)
    except redis.RedisError as exc:
        logger.warning("cannot record that %s holds %s: %s", task.request.hostname, task_id, exc)


@signals.task_postrun.connect
def _on_task_postrun(task_id: str, task: Task, retval: Any = None, state: str | None = None, **kwargs: Any) -> None:
    try:
        cluster.release(client(), task.request.hostname, task_id)
        if state == "SUCCESS" and isinstance(retval, dict) and retval.get("status") == "committed":
            shard_metrics.record_shard(
                client(),
                task=_task_kind(task.name),
                seconds=float(retval.get("seconds", 0.0)),
                bytes_written=int(retval.get("bytes", 0)),
                tokens=int(retval.get("num_tokens", 0)),
            )
    except redis.RedisError as exc:
        logger.warning("cannot record the end of %s: %s", task_id, exc)


@signals.task_retry.connect
def _on_task_retry(request: Any, reason: BaseException, **kwargs: Any) -> None:
    # autoretry_for raises celery's Retry; the error that caused it is its `exc`.
    _failure(request.task, "retry", getattr(reason, "exc", None) or reason)


@signals.task_failure.connect
def _on_task_failure(sender: Task, exception: BaseException, **kwargs: Any) -> None:
    _failure(sender.name, "dead_lettered", exception)


def _failure(task_name: str, outcome: str, error: BaseException) -> None:
    try:
        shard_metrics.record_failure(client(), task=_task_kind(task_name), outcome=outcome, reason=type(error).__name__)
    except redis.RedisError as exc:
        logger.warning("cannot count a %s of %s: %s", outcome, task_name, exc)
