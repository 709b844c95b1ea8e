"""Celery tasks: one per job kind, each running the shared shard lifecycle (shared/shards.py) for its kind.
Retries only the transient errors; a shard that fails for good leaves a dead letter with its reason."""

import logging
import os
import socket
from functools import cache
from typing import Any

import redis
from celery import Task

from services.worker.celery_app import app, settings
from shared import shards
from shared.errors import TransientError
from shared.kinds import KINDS, JobKind
from shared.storage import open_storage

logger = logging.getLogger(__name__)


@cache
def context() -> shards.ShardContext:
    # Built lazily in each pool process: clients created before the prefork fork must not be shared.
    return shards.ShardContext(
        storage=open_storage(settings.storage_url, settings),
        redis=redis.Redis.from_url(settings.redis_url, socket_timeout=30, socket_connect_timeout=10),
        settings=settings,
        worker=f"{socket.gethostname()}:{os.getpid()}",
    )


class ShardTask(Task):
    kind: JobKind  # set per registered task

    def on_failure(self, exc: BaseException, task_id: str, args: tuple, kwargs: dict, einfo: Any) -> None:
        # Called once retries are exhausted or the error is not transient: record why, never drop silently.
        job_id, shard_index = args
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
        return shards.run_shard(self.kind, job_id, shard_index, context()).model_dump()

    return run_shard


SHARD_TASKS = {name: register(kind) for name, kind in KINDS.items()}
