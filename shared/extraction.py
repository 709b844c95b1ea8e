"""One shard, end to end: capture each sample's hidden states, validate, write the sample files,
then commit the manifest create-only and count it once. Every step is idempotent, so a redelivered
or duplicated task never produces a second or a torn shard."""

import hashlib
import logging
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Literal

import redis
from pydantic import BaseModel

from shared import layout, progress
from shared.capture_protocol import CapturedStates
from shared.errors import ModelMismatch, ShardValidationError
from shared.inference_client import InferenceClient
from shared.jobs import load_job, load_shard_input
from shared.schemas import DeadLetter, JobRecord, Manifest, ManifestSample, SampleInput, utc_now
from shared.shard_format import InvalidCapture, encode_sample, validate_capture
from shared.storage import Storage

logger = logging.getLogger(__name__)


class ShardOutcome(BaseModel):
    job_id: str
    shard_index: int
    status: Literal["committed", "already_committed", "cancelled"]
    num_samples: int = 0
    num_tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0

    @classmethod
    def of(
        cls, manifest: Manifest, status: Literal["committed", "already_committed"], seconds: float = 0.0
    ) -> "ShardOutcome":
        return cls(
            job_id=manifest.job_id,
            shard_index=manifest.shard_index,
            status=status,
            seconds=seconds,
            num_samples=manifest.num_samples,
            num_tokens=manifest.num_tokens,
            bytes=manifest.bytes,
        )


def check_model(job: JobRecord, inference: InferenceClient) -> None:
    """The server must serve the model the job was planned for; otherwise every tensor would be wrong."""
    info = inference.model_info()
    expected = {
        "hidden_size": job.hidden_size,
        "num_hidden_layers": job.model.num_hidden_layers,
        "vocab_size": job.model.vocab_size,
    }
    served = {name: getattr(info, name) for name in expected}
    if served != expected:
        raise ModelMismatch(
            f"job {job.job_id} was planned for {job.model.path} {expected}, "
            f"but {inference.base_url} serves {info.model_path} {served}"
        )
    if info.capture_aux_layer_ids is not None and sorted(info.capture_aux_layer_ids) != sorted(job.aux_layer_ids):
        raise ModelMismatch(
            f"job {job.job_id} captures layers {job.aux_layer_ids}, but {inference.base_url} was launched to capture "
            f"{info.capture_aux_layer_ids} (EAGLE3_AUX_LAYER_IDS of the SGLang container)"
        )


def describe_sample(sample: SampleInput, key: str, data: bytes) -> ManifestSample:
    """A sample file's manifest entry: where it is, its token counts, size and sha256."""
    return ManifestSample(
        sample_index=sample.sample_index,
        sample_id=sample.sample_id,
        key=key,
        num_tokens=len(sample.input_ids),
        loss_tokens=sum(sample.loss_mask),
        bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
    )


def commit_sample(
    storage: Storage, job: JobRecord, shard_index: int, sample: SampleInput, states: CapturedStates
) -> tuple[ManifestSample, bool]:
    """Validate, encode, hash and write one sample file create-only; True if this call created it.
    Runs in the writer pool, so the next captures keep arriving while this one is written."""
    try:
        validate_capture(
            states.aux_hidden_state, states.hidden_state, num_tokens=len(sample.input_ids), hidden_size=job.hidden_size
        )
    except InvalidCapture as exc:
        raise ShardValidationError(job.job_id, shard_index, sample.sample_id, exc.field, exc.reason) from exc
    key = layout.sample(job.job_id, sample.sample_index)
    data = encode_sample(
        sample.input_ids,
        sample.loss_mask,
        states.aux_hidden_state,
        states.hidden_state,
        storage_dtype=job.spec.storage_dtype,
    )
    if storage.put_if_absent(key, data):
        return describe_sample(sample, key, data), True
    # A concurrent duplicate delivery wrote it first: describe what is stored, which the manifest must match.
    return describe_sample(sample, key, storage.get(key)), False


def capture_and_write(
    storage: Storage,
    job: JobRecord,
    shard_index: int,
    samples: list[SampleInput],
    inference: InferenceClient,
    *,
    write_concurrency: int,
) -> list[ManifestSample]:
    """Capture every sample and write its file, the inference requests and the writes overlapping.
    All or nothing: on any failure the files this call created are deleted before the error propagates."""
    created: list[str] = []
    lock = threading.Lock()
    failed = threading.Event()

    def commit_in_pool(sample: SampleInput, states: CapturedStates) -> ManifestSample:
        try:
            entry, was_created = commit_sample(storage, job, shard_index, sample, states)
        except BaseException:
            failed.set()
            raise
        if was_created:
            with lock:
                created.append(entry.key)
        return entry

    attempt = uuid.uuid4().hex[:8]  # a fresh rid per attempt: SGLang's radix cache must not serve a prefix hit
    requests = [(f"{job.job_id}/{shard_index}/{s.sample_index}/{attempt}", s.input_ids) for s in samples]
    in_flight = threading.BoundedSemaphore(write_concurrency)  # bounds the captured tensors held in memory
    futures: list[Future[ManifestSample]] = []
    with ThreadPoolExecutor(max_workers=write_concurrency, thread_name_prefix="write") as writers:
        try:
            for sample, states in zip(samples, inference.capture_many(requests, job.aux_layer_ids), strict=True):
                in_flight.acquire()
                future = writers.submit(commit_in_pool, sample, states)
                future.add_done_callback(lambda _: in_flight.release())
                futures.append(future)
                if failed.is_set():  # stop capturing; the failed future raises below
                    break
            return [future.result() for future in futures]
        except BaseException:
            for future in futures:
                future.cancel()
            wait(futures)
            for key in created:  # nothing of a shard that failed stays behind
                storage.delete(key)
            raise


def extract_shard(
    job_id: str,
    shard_index: int,
    *,
    storage: Storage,
    redis_client: redis.Redis,
    inference: InferenceClient,
    worker: str,
    checked_models: set[str] | None = None,
    write_concurrency: int = 4,
    ready_timeout_s: float = 300.0,
) -> ShardOutcome:
    started, started_at = time.monotonic(), utc_now()
    manifest_key = layout.manifest(job_id, shard_index)
    if storage.exists(manifest_key):
        manifest = Manifest.model_validate_json(storage.get(manifest_key))
        # A worker that died between commit and count left the shard uncounted; counting is idempotent.
        progress.record_commit(redis_client, manifest)
        return ShardOutcome.of(manifest, "already_committed")
    if progress.is_cancelled(redis_client, job_id):
        return ShardOutcome(job_id=job_id, shard_index=shard_index, status="cancelled")

    job = load_job(storage, job_id)
    if checked_models is None or job_id not in checked_models:
        # A GPU server answers 503 for minutes while it compiles kernels; that is a wait, not a failure.
        inference.wait_ready(ready_timeout_s)
        check_model(job, inference)
        if checked_models is not None:
            checked_models.add(job_id)
    shard = load_shard_input(storage, job_id, shard_index)

    entries: dict[int, ManifestSample] = {}
    pending: list[SampleInput] = []
    for sample in shard.samples:
        key = layout.sample(job_id, sample.sample_index)
        if storage.exists(key):  # written by an earlier attempt that died before the manifest
            entries[sample.sample_index] = describe_sample(sample, key, storage.get(key))
        else:
            pending.append(sample)

    for entry in capture_and_write(storage, job, shard_index, pending, inference, write_concurrency=write_concurrency):
        entries[entry.sample_index] = entry
    capture_s = time.monotonic() - started

    samples = [entries[s.sample_index] for s in shard.samples]
    manifest = Manifest(
        job_id=job_id,
        shard_index=shard_index,
        aux_layer_ids=job.aux_layer_ids,
        hidden_size=job.hidden_size,
        dtype=job.dtype,
        samples=samples,
        num_samples=len(samples),
        num_tokens=sum(s.num_tokens for s in samples),
        loss_tokens=sum(s.loss_tokens for s in samples),
        bytes=sum(s.bytes for s in samples),
        worker=worker,
        started_at=started_at,
        committed_at=utc_now(),
        timings_s={"capture_and_write": round(capture_s, 4), "total": round(time.monotonic() - started, 4)},
    )
    manifest = progress.commit_manifest(storage, redis_client, manifest)
    seconds = time.monotonic() - started
    logger.info(
        "committed job=%s shard=%d samples=%d tokens=%d bytes=%d in %.2fs (%d reused)",
        job_id,
        shard_index,
        manifest.num_samples,
        manifest.num_tokens,
        manifest.bytes,
        seconds,
        len(shard.samples) - len(pending),
    )
    return ShardOutcome.of(manifest, "committed", seconds=seconds)


def dead_letter(
    job_id: str,
    shard_index: int,
    error: BaseException,
    *,
    retries: int,
    storage: Storage,
    redis_client: redis.Redis,
    worker: str,
) -> DeadLetter:
    """Record a shard that will not be committed, with its reason; the job goes on without it."""
    letter = DeadLetter(
        job_id=job_id,
        shard_index=shard_index,
        error_type=type(error).__name__,
        reason=str(error),
        retries=retries,
        worker=worker,
    )
    shard = load_shard_input(storage, job_id, shard_index)
    storage.put(layout.dead_letter(job_id, shard_index), letter.model_dump_json(indent=1).encode())
    progress.record_dead_letter(redis_client, letter, num_samples=len(shard.samples), num_tokens=shard.num_tokens)
    logger.error(
        "dead-lettered job=%s shard=%d after %d retries: %s: %s",
        job_id,
        shard_index,
        retries,
        letter.error_type,
        letter.reason,
    )
    return letter
