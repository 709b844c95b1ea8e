"""A job of any kind, from the producer's side: submit (services up, model folder, job id, tokenizer, layer ids, the
dataset with its rejected lines, the kind's plan, budget, plan files, job.json, one task per shard), resume and the
job record's loading. What differs between kinds comes from shared/lifecycle/kinds/."""

import logging
import secrets
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis
import torch
import transformers
from pydantic import BaseModel

import shared
from shared import access, urls
from shared.data.datasets import InvalidRecord, read_dataset
from shared.data.tokenization import ChatTokenizer
from shared.errors import (
    ConfigurationError,
    DependencyUnavailable,
    Eagle3Error,
    JobDeleting,
    JobExists,
    SubmitError,
)
from shared.lifecycle import budget, progress, recovery, shard_metrics
from shared.lifecycle.kind import Target, read_shard_input
from shared.lifecycle.kinds import kind_of
from shared.lifecycle.schemas import JobRecord, JobSpec, RejectedSample, utc_now
from shared.lifecycle.shards import load_job
from shared.settings import Settings
from shared.storage import layout, locations
from shared.storage.objects import ObjectNotFound, Storage

logger = logging.getLogger(__name__)

# A sized shard stays between a small file's worth and what one retry can afford to repeat.
MIN_SIZED_SHARD_TOKENS, MAX_SIZED_SHARD_TOKENS = 2048, 1_048_576

Enqueue = recovery.Enqueue


def load_shard_input(storage: Storage, job: JobRecord, shard_index: int) -> BaseModel:
    """The planned input of one shard of a job, whatever its kind."""
    return read_shard_input(kind_of(job.kind), storage, job.job_id, shard_index)


def new_job_id() -> str:
    return f"job-{datetime.now(UTC):%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


def read_dataset_lines(url: str, settings: Settings) -> Iterator[bytes]:
    """Lines of a JSONL dataset at a local path, file:// URL or s3:// URL."""
    url = access.confine_dataset_url(url, settings)
    try:
        yield from locations.read_lines(url, settings)
    except ObjectNotFound as exc:
        raise SubmitError(f"dataset {url} not found") from exc
    except ConfigurationError as exc:
        raise SubmitError(f"dataset {exc}") from exc


def resolve_model(spec: JobSpec, settings: Settings) -> Path:
    value = spec.model_path or (str(settings.model_path) if settings.model_path else None)
    if value is None:
        raise SubmitError("no target model: give model_path in the job or set EAGLE3_MODEL_PATH")
    path = access.confine_model_path(value, settings)
    if not (path / "config.json").is_file():
        raise SubmitError(f"model folder {path} not found (no config.json there)")
    return path.resolve()


def check_services(settings: Settings, storage: Storage, client: redis.Redis) -> None:
    try:
        client.ping()
    except redis.RedisError as exc:
        raise DependencyUnavailable(f"Redis at {urls.redact_url(settings.redis_url)} is not reachable: {exc}") from exc
    try:
        storage.check()
    except Eagle3Error as exc:
        raise DependencyUnavailable(f"storage {storage.url} is not usable: {exc}") from exc


def submit(spec: JobSpec, *, settings: Settings, storage: Storage, client: redis.Redis, enqueue: Enqueue) -> JobRecord:
    """Plan a job of any kind and enqueue its shards. Raises SubmitError (OverBudget among them) before anything is
    enqueued; a job whose job.json exists is fully planned."""
    started = time.monotonic()
    kind = kind_of(spec.kind)
    check_services(settings, storage, client)
    spec = kind.complete_spec(spec, storage)
    model_path = resolve_model(spec, settings)
    job_id = spec.job_id or new_job_id()
    if storage.exists(layout.job_json(job_id)):
        raise JobExists(f"job {job_id} already exists in {storage.url}; resume it instead")
    if recovery.deleting_detail(storage, job_id) is not None:  # its job.json gone, the rest of the delete not yet
        raise JobDeleting(job_id)
    kind.check_spec(spec, settings)
    spec = sized_shards(spec, client)
    try:
        tokenizer = ChatTokenizer.from_pretrained(model_path)
    except ConfigurationError as exc:
        raise SubmitError(str(exc)) from exc
    target = Target.load(model_path, tokenizer, spec.aux_layer_ids)
    check_aux_layer_ids(target.aux_layer_ids, target.num_hidden_layers)

    accepted: list[Any] = []
    rejected: list[RejectedSample] = []
    if not kind.reads_dataset:
        accepted = kind.select(spec, storage)
    elif spec.dataset_url is None:
        raise SubmitError(f"dataset_url: a job of kind {kind.name!r} reads a dataset")
    else:
        for record in read_dataset(read_dataset_lines(spec.dataset_url, settings)):
            try:
                if isinstance(record, InvalidRecord):
                    raise record
                accepted.append(kind.accept(record, spec, target))
            except InvalidRecord as exc:
                rejected.append(
                    RejectedSample(sample_id=exc.sample_id, line=exc.line, field=exc.field, reason=exc.reason)
                )
    if not accepted:
        raise SubmitError(
            f"dataset {spec.dataset_url}: no usable sample ({len(rejected)} rejected, e.g. {first_rejection(rejected)})"
        )

    spec = spec.model_copy(
        update={"job_id": job_id, "model_path": str(model_path), "aux_layer_ids": target.aux_layer_ids}
    )
    plan = kind.plan(job_id, spec, target, accepted)
    budget.check_submit(client, settings, job_id, plan.projected_bytes, spec.storage_budget_bytes)
    job = JobRecord(
        job_id=job_id,
        created_at=utc_now(),
        spec=spec,
        model=target.record(),
        aux_layer_ids=target.aux_layer_ids,
        hidden_size=target.hidden_size,
        bytes_per_token=plan.bytes_per_token,
        samples_total=plan.samples_total,
        samples_rejected=len(rejected),
        tokens_total=plan.tokens_total,
        shards_total=len(plan.shards),
        projected_bytes=plan.projected_bytes,
        versions={"eagle3": shared.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
        **plan.record,
    )

    for key, data in plan.files.items():
        storage.put(key, data)
    storage.put(layout.rejected(job_id), "".join(r.model_dump_json() + "\n" for r in rejected).encode())
    for shard in plan.shards:
        storage.put(layout.shard_input(job_id, shard.shard_index), shard.model_dump_json().encode())
    publish_job(storage, client, job, enqueue=enqueue)
    logger.info(
        "submitted %s job=%s samples=%d rejected=%d tokens=%d shards=%d in %.1fs",
        kind.name,
        job_id,
        plan.samples_total,
        len(rejected),
        plan.tokens_total,
        len(plan.shards),
        time.monotonic() - started,
    )
    return job


def sized_shards(spec: JobSpec, client: redis.Redis) -> JobSpec:
    """An extraction job with `shard_seconds`: its shard token budget is that many seconds of one worker's measured
    rate (the cluster's last extraction shards), so that a shard is seconds of a GPU's work and not milliseconds;
    before any shard was measured, the budget given. The budget used is the one recorded in job.json."""
    if spec.shard_seconds is None or spec.kind != "extract":
        return spec  # a regenerate job passes shard_seconds on to its chained extraction job
    rate = shard_metrics.recent_rate(client, "extract")
    if rate is None:
        logger.warning(
            "shard_seconds=%s: no extraction shard measured yet; %d tokens a shard",
            spec.shard_seconds,
            spec.shard_token_budget,
        )
        return spec
    budget = round(min(max(rate * spec.shard_seconds, MIN_SIZED_SHARD_TOKENS), MAX_SIZED_SHARD_TOKENS))
    logger.info(
        "shard_seconds=%s at a measured %.0f tokens/s per worker: %d tokens a shard", spec.shard_seconds, rate, budget
    )
    return spec.model_copy(update={"shard_token_budget": budget})


def check_aux_layer_ids(aux_layer_ids: list[int], num_layers: int) -> None:
    if sorted(aux_layer_ids) != aux_layer_ids or not all(0 <= i < num_layers for i in aux_layer_ids):
        raise SubmitError(f"aux_layer_ids {aux_layer_ids}: must be increasing ids in [0, {num_layers})")


def publish_job(storage: Storage, client: redis.Redis, job: JobRecord, *, enqueue: Enqueue) -> None:
    """After every plan file: the job's index entry and publishing, job.json (create-only; a job whose job.json
    exists is fully planned), its progress counters, then one task per shard, checkpointed: a reaper finishes the
    job's registration and enqueueing if this process dies or loses Redis (shared/lifecycle/recovery.py)."""
    recovery.index_job(storage, job.job_id)
    recovery.begin_publishing(client, job.job_id)
    if not storage.put_if_absent(layout.job_json(job.job_id), job.model_dump_json(indent=2).encode()):
        raise JobExists(f"job {job.job_id} was created concurrently by another submit")
    progress.register_job(client, job, storage.url, kind_of(job.kind))
    recovery.publish(storage, client, job, enqueue=enqueue)


def first_rejection(rejected: list[RejectedSample]) -> str:
    return f"line {rejected[0].line}: {rejected[0].field}: {rejected[0].reason}" if rejected else "empty dataset"


def cancel(job_id: str, *, storage: Storage, client: redis.Redis) -> None:
    """Queued shards are skipped; in storage too, so that the job stays cancelled if Redis loses its state."""
    progress.cancel(client, job_id)
    storage.put(layout.cancelled(job_id), b"")


def resume(job_id: str, *, storage: Storage, client: redis.Redis, enqueue: Enqueue) -> list[int]:
    """Re-enqueue every shard without a manifest (dead-lettered ones included) after recounting from storage, plus
    whatever the kind asks to run again; returns the uncommitted shards."""
    job = load_job(storage, job_id)
    if recovery.deleting_detail(storage, job_id) is not None:
        raise JobDeleting(job_id)
    kind = kind_of(job.kind)
    recovery.index_job(storage, job_id)  # a job published before the index existed
    if not client.exists(progress.job_key(job_id)):
        progress.register_job(client, job, storage.url, kind)
    progress.uncancel(client, job_id)
    storage.delete(layout.cancelled(job_id))
    progress.rebuild(client, storage, job, kind)
    committed = {layout.shard_index_from_manifest_key(k) for k in storage.list(layout.manifests_prefix(job_id))}
    pending = [k for k in range(job.shards_total) if k not in committed]

    def retry(shard_index: int) -> None:
        samples, tokens = kind.dead_shard_size(storage, job_id, shard_index)  # as rebuild counted it
        progress.forget_dead_letter(client, job_id, shard_index, num_samples=samples, num_tokens=tokens)
        storage.delete(layout.dead_letter(job_id, shard_index))

    # Checkpointed like a submit's enqueueing: a reaper finishes it if this process dies half way.
    recovery.publish(storage, client, job, enqueue=enqueue, retry_dead=retry)
    for shard_index in kind.after_resume(storage, client, job, pending):
        enqueue(job.kind, job_id, shard_index)
    logger.info("resumed %s job=%s pending_shards=%d", kind.name, job_id, len(pending))
    return pending
