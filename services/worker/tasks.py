"""Celery tasks: one per job kind, each running the shared shard lifecycle (shared/lifecycle/shards.py) for its kind.
Retries only the transient errors; a shard that fails for good leaves a dead letter with its reason.

A shard never ends without an outcome the job can see: committed, dead-lettered, or a message that runs it again
(a retry, a pause for storage). Where none of these can be recorded (Redis or storage down too), the run ends and
its lease goes to the reaper (services/worker/leasing.py), which sends the shard again once it can."""

import logging
import os
import socket
from functools import cache
from typing import Any

from celery import Task
from celery.exceptions import Retry

from services.worker.celery_app import app, settings
from shared.errors import OverStorageBudget, QueueUnavailable, StorageFull, StorageUnavailable, TransientError
from shared.lifecycle import progress, shards
from shared.lifecycle.kind import ShardContext
from shared.lifecycle.kinds import KINDS, JobKind
from shared.storage.objects import open_storage

logger = logging.getLogger(__name__)
LEASED_REQUEST = "services.worker.leasing:LeasedRequest"  # a shard's lease ends with its message


@cache
def context() -> ShardContext:
    # Built lazily in each pool process: clients created before the prefork fork must not be shared.
    return ShardContext(
        storage=open_storage(settings.storage_url, settings),
        redis=progress.connect(settings.redis_url, outage_wait_s=settings.redis_outage_wait_s),
        settings=settings,
        worker=f"{socket.gethostname()}:{os.getpid()}",
    )


class ShardTask(Task):
    kind: JobKind  # set per registered task
    Request = LEASED_REQUEST

    def on_failure(self, exc: BaseException, task_id: str, args: tuple, kwargs: dict, einfo: Any) -> None:
        # Called once retries are exhausted or the error is not transient: record why, never drop silently. If the
        # dead letter cannot be written either, the lease reaper sends the shard again (leasing.LeasedRequest).
        job_id, shard_index = args
        try:
            shards.dead_letter(self.kind, job_id, shard_index, exc, retries=self.request.retries, ctx=context())
        except Exception as record_error:
            logger.error(
                "shard %s failed and its dead letter cannot be written (%s: %s); the lease reaper sends it again",
                task_id,
                type(record_error).__name__,
                record_error,
            )


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
        except progress.REDIS_OUTAGE_ERRORS as exc:
            # Still down after the client's own retries. If the broker (the same Redis) cannot take the retry either,
            # Celery rejects the message and the lease reaper sends the shard again once Redis is back.
            raise QueueUnavailable(f"Redis unreachable for over {settings.redis_outage_wait_s:.0f}s: {exc}") from exc
        except StorageUnavailable as exc:
            if not isinstance(exc, StorageFull) and self.request.retries < self.max_retries:
                raise  # a retry with backoff (autoretry_for)
            # Storage full, or still unreachable after the retries: no fault of the shard's. It waits, the job paused
            # with the reason, and runs again after `storage_wait_s` however long that takes: a full store keeps its
            # retry count (it spends no attempt), an unreachable one starts afresh.
            if isinstance(exc, OverStorageBudget):
                reason = "over the storage budget"
            else:
                reason = "storage full" if isinstance(exc, StorageFull) else "storage unavailable"
            shards.pause(context(), job_id, shard_index, f"{reason}: {exc}")
            retries = self.request.retries if isinstance(exc, StorageFull) else 0
            countdown = settings.storage_wait_s
            self.apply_async(args=[job_id, shard_index], task_id=self.request.id, countdown=countdown, retries=retries)
            raise Retry(exc=exc, when=countdown) from exc

    return run_shard


SHARD_TASKS = {name: register(kind) for name, kind in KINDS.items()}
