"""Celery tasks: one per job kind, each running the shared shard lifecycle (shared/shards.py) for its kind.
Retries only the transient errors; a shard that fails for good leaves a dead letter with its reason."""

import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

import redis
from celery import Task
from celery.exceptions import Retry

from services.worker.celery_app import app, settings
from shared import shards
from shared.errors import StorageFull, StorageUnavailable, TransientError
from shared.kinds import KINDS, JobKind
from shared.storage import open_storage

logger = logging.getLogger(__name__)
LEASED_REQUEST = "services.worker.leasing:LeasedRequest"  # a shard's lease ends with its message
FAILURE_RECORD_RETRY_S = 60.0  # a shard whose dead letter could not be written runs again after this


@cache
def context() -> shards.ShardContext:
    # Built lazily in each pool process: clients created before the prefork fork must not be shared.
    return shards.ShardContext(
        storage=open_storage(settings.storage_url, settings),
        redis=redis.Redis.from_url(settings.redis_url, socket_timeout=30, socket_connect_timeout=10),
        settings=settings,
        worker=f"{socket.gethostname()}:{os.getpid()}",
    )


@contextmanager
def failure_kept(task: Task, task_id: str, args: tuple) -> Iterator[None]:
    """Around recording a shard's failure: if that fails too (storage or Redis down as well), the shard's message is
    acknowledged all the same, and the shard would vanish, neither committed nor dead-lettered. Send it again."""
    try:
        yield
    except Exception as exc:
        logger.error(
            "shard %s failed and its dead letter cannot be written (%s: %s); queued again in %.0fs",
            task_id,
            type(exc).__name__,
            exc,
            FAILURE_RECORD_RETRY_S,
        )
        task.apply_async(args=args, task_id=task_id, countdown=FAILURE_RECORD_RETRY_S)


class ShardTask(Task):
    kind: JobKind  # set per registered task
    Request = LEASED_REQUEST

    def on_failure(self, exc: BaseException, task_id: str, args: tuple, kwargs: dict, einfo: Any) -> None:
        # Called once retries are exhausted or the error is not transient: record why, never drop silently.
        job_id, shard_index = args
        if isinstance(exc, StorageUnavailable):
            # Still unreachable after the retries: a dead letter would have to go to that same storage, and the
            # shard is not at fault. It waits, the job paused with the reason, and runs with fresh attempts later.
            shards.pause(context(), job_id, shard_index, f"storage unavailable: {exc}")
            self.apply_async(args=args, task_id=task_id, countdown=settings.storage_wait_s)
            return
        with failure_kept(self, task_id, args):
            shards.dead_letter(self.kind, job_id, shard_index, exc, retries=self.request.retries, ctx=context())


def register(kind: JobKind) -> Task:
    @app.task(
        bind=True,
        base=ShardTask,
        kind=kind,
        name=kind.task_name,
        autoretry_for=(TransientError,),
        retry_backoff=True,
        retry_backoff_max=settings.retry_backoff_max_s,
        retry_jitter=True,
        max_retries=settings.task_max_retries,
    )
    def run_shard(self: ShardTask, job_id: str, shard_index: int) -> dict:
        try:
            return shards.run_shard(self.kind, job_id, shard_index, context()).model_dump()
        except StorageFull as exc:
            # A full store is no fault of the shard's: it waits for room however long that takes, spending no attempt
            # (the same retry count goes with it), so the job goes on by itself once there is room.
            countdown = settings.storage_wait_s
            self.apply_async(
                args=[job_id, shard_index], task_id=self.request.id, countdown=countdown, retries=self.request.retries
            )
            raise Retry(exc=exc, when=countdown) from exc

    return run_shard


SHARD_TASKS = {name: register(kind) for name, kind in KINDS.items()}
