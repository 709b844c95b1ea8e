"""Celery tasks: parse, call one `shared` function, translate. Retries only the transient errors."""

import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import redis
from celery import Task

from services.worker.celery_app import app, settings
from shared import extraction, regeneration
from shared.capture_protocol import ModelInfo
from shared.errors import TransientError
from shared.inference_client import InferenceClient
from shared.queue import EXTRACT_TASK, REGENERATE_TASK
from shared.storage import Storage, open_storage

logger = logging.getLogger(__name__)
LEASED_REQUEST = "services.worker.leasing:LeasedRequest"  # a shard's lease ends with its message
FAILURE_RECORD_RETRY_S = 60.0  # a shard whose dead letter could not be written runs again after this


@dataclass
class WorkerResources:
    storage: Storage
    redis_client: redis.Redis
    inference: InferenceClient
    decoding: InferenceClient  # regeneration: more requests in flight, so that the server batches them
    name: str
    checked_models: set[str] = field(default_factory=set)
    served_models: dict[str, ModelInfo] = field(default_factory=dict)
    tokenizers: regeneration.TokenizerCache = field(default_factory=regeneration.TokenizerCache)


@cache
def resources() -> WorkerResources:
    # Built lazily in each pool process: clients created before the prefork fork must not be shared.
    return WorkerResources(
        storage=open_storage(settings.storage_url, settings),
        redis_client=redis.Redis.from_url(settings.redis_url, socket_timeout=30, socket_connect_timeout=10),
        inference=InferenceClient(
            settings.inference_url,
            timeout_s=settings.inference_timeout_s,
            max_concurrency=settings.inference_concurrency,
            transport=settings.capture_transport,
            shm_dir=settings.shm_dir,
        ),
        decoding=InferenceClient(
            settings.inference_url,
            timeout_s=settings.inference_timeout_s,
            max_concurrency=settings.regenerate_concurrency,
        ),
        name=f"{socket.gethostname()}:{os.getpid()}",
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
    Request = LEASED_REQUEST

    def on_failure(self, exc: BaseException, task_id: str, args: tuple, kwargs: dict, einfo: Any) -> None:
        # Called once retries are exhausted or the error is not transient: record why, never drop silently.
        job_id, shard_index = args
        r = resources()
        with failure_kept(self, task_id, args):
            extraction.dead_letter(
                job_id,
                shard_index,
                exc,
                retries=self.request.retries,
                storage=r.storage,
                redis_client=r.redis_client,
                worker=r.name,
            )


@app.task(
    bind=True,
    base=ShardTask,
    name=EXTRACT_TASK,
    autoretry_for=(TransientError,),
    retry_backoff=True,
    retry_backoff_max=settings.retry_backoff_max_s,
    retry_jitter=True,
    max_retries=settings.task_max_retries,
)
def extract_shard(self: Task, job_id: str, shard_index: int) -> dict:
    r = resources()
    outcome = extraction.extract_shard(
        job_id,
        shard_index,
        storage=r.storage,
        redis_client=r.redis_client,
        inference=r.inference,
        worker=r.name,
        checked_models=r.checked_models,
        write_concurrency=settings.write_concurrency,
        ready_timeout_s=settings.inference_ready_timeout_s,
    )
    return outcome.model_dump()


class RegenerateShardTask(Task):
    Request = LEASED_REQUEST

    def on_failure(self, exc: BaseException, task_id: str, args: tuple, kwargs: dict, einfo: Any) -> None:
        job_id, shard_index = args
        r = resources()
        with failure_kept(self, task_id, args):
            regeneration.record_task_failure(
                job_id,
                shard_index,
                exc,
                retries=self.request.retries,
                storage=r.storage,
                redis_client=r.redis_client,
                worker=r.name,
            )


@app.task(
    bind=True,
    base=RegenerateShardTask,
    name=REGENERATE_TASK,
    autoretry_for=(TransientError,),
    retry_backoff=True,
    retry_backoff_max=settings.retry_backoff_max_s,
    retry_jitter=True,
    max_retries=settings.task_max_retries,
)
def regenerate_shard(self: Task, job_id: str, shard_index: int) -> dict:
    r = resources()
    outcome = regeneration.regenerate_shard(
        job_id,
        shard_index,
        storage=r.storage,
        redis_client=r.redis_client,
        inference=r.decoding,
        worker=r.name,
        # The producer plans the chained extraction job: it has the model folder, and the plan is its job.
        chain=lambda spec: regeneration.submit_through_api(spec, settings),
        tokenizers=r.tokenizers,
        model_infos=r.served_models,
        concurrency=settings.regenerate_concurrency,
        ready_timeout_s=settings.inference_ready_timeout_s,
        settings=settings,
    )
    return outcome.model_dump()
