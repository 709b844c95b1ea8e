"""Job submission: read and tokenize the dataset, build the vocab mapping, plan shards, check the budget,
write job.json and the shard inputs, then enqueue one task per shard. Also resume and cancel."""

import json
import logging
import secrets
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlparse

import redis
import torch
import transformers

import shared
from shared import layout, progress
from shared.datasets import InvalidRecord, read_dataset
from shared.errors import (
    ConfigurationError,
    DependencyUnavailable,
    Eagle3Error,
    JobNotFound,
    OverBudget,
    SubmitError,
)
from shared.provenance import compute_provenance
from shared.schemas import (
    JobRecord,
    JobSpec,
    ModelRecord,
    RejectedSample,
    SampleInput,
    ShardInput,
    StorageDtype,
    utc_now,
)
from shared.settings import Settings
from shared.storage import ObjectNotFound, Storage, open_storage
from shared.tokenization import ChatTokenizer, TokenizedSample
from shared.vocab import build_vocab_mapping, count_loss_tokens, vocab_mapping_bytes

logger = logging.getLogger(__name__)

Enqueue = Callable[[str, int], None]
# torch.save's zip container and the int64 input_ids/loss_mask add a little to the raw bf16 bytes.
PER_SAMPLE_OVERHEAD_BYTES = 1536


def default_aux_layer_ids(num_hidden_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high layers: HF output_hidden_states[i + 1] for each id."""
    return [1, num_hidden_layers // 2 - 1, num_hidden_layers - 4]


def bytes_per_token(hidden_size: int, storage_dtype: StorageDtype = "bfloat16") -> int:
    # 3 aux + 1 final state in bf16, plus int64 input_ids and loss_mask; fp8 adds 4 float32 scales (shard_format.py).
    if storage_dtype == "fp8_e4m3":
        return 4 * hidden_size * 1 + 4 * 4 + 2 * 8
    return 4 * hidden_size * 2 + 2 * 8


def new_job_id() -> str:
    return f"job-{datetime.now(UTC):%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


def read_dataset_lines(url: str, settings: Settings) -> Iterator[bytes]:
    """Lines of a JSONL dataset at a local path, file:// URL or s3:// URL."""
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        try:
            data = open_storage(f"s3://{parsed.netloc}", settings).get(parsed.path.lstrip("/"))
        except ObjectNotFound as exc:
            raise SubmitError(f"dataset {url} not found") from exc
        yield from data.splitlines()
        return
    path = Path(parsed.path) if parsed.scheme == "file" else Path(url)
    if parsed.scheme not in ("", "file"):
        raise SubmitError(f"dataset {url}: unsupported scheme {parsed.scheme!r} (use a path, file:// or s3://)")
    if not path.is_file():
        raise SubmitError(f"dataset {url} not found")
    with path.open("rb") as f:
        yield from f


def resolve_model(spec: JobSpec, settings: Settings) -> Path:
    value = spec.model_path or (str(settings.model_path) if settings.model_path else None)
    if value is None:
        raise SubmitError("no target model: give model_path in the job or set EAGLE3_MODEL_PATH")
    path = Path(value)
    if not (path / "config.json").is_file():
        raise SubmitError(f"model folder {path} not found (no config.json there)")
    return path.resolve()


def check_services(settings: Settings, storage: Storage, client: redis.Redis) -> None:
    try:
        client.ping()
    except redis.RedisError as exc:
        raise DependencyUnavailable(f"Redis at {settings.redis_url} is not reachable: {exc}") from exc
    try:
        storage.check()
    except Eagle3Error as exc:
        raise DependencyUnavailable(f"storage {storage.url} is not usable: {exc}") from exc


def plan_shards(samples: list[TokenizedSample], token_budget: int) -> list[list[int]]:
    """Consecutive samples grouped until the next would pass the token budget; deterministic in input order."""
    shards: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for index, sample in enumerate(samples):
        if current and tokens + sample.num_tokens > token_budget:
            shards.append(current)
            current, tokens = [], 0
        current.append(index)
        tokens += sample.num_tokens
    if current:
        shards.append(current)
    return shards


def submit(spec: JobSpec, *, settings: Settings, storage: Storage, client: redis.Redis, enqueue: Enqueue) -> JobRecord:
    """Plan a job and enqueue its shards. Raises SubmitError (OverBudget among them) before anything is enqueued."""
    started = time.monotonic()
    if spec.kind != "extract":
        raise SubmitError(f"job kind {spec.kind!r}: jobs.submit plans extraction jobs (see shared/regeneration.py)")
    check_services(settings, storage, client)
    model_path = resolve_model(spec, settings)
    job_id = spec.job_id or new_job_id()
    if storage.exists(layout.job_json(job_id)):
        raise SubmitError(f"job {job_id} already exists in {storage.url}; resume it instead")
    try:
        tokenizer = ChatTokenizer.from_pretrained(model_path)
    except ConfigurationError as exc:
        raise SubmitError(str(exc)) from exc
    model_config = json.loads((model_path / "config.json").read_text())
    num_layers, hidden_size = model_config["num_hidden_layers"], model_config["hidden_size"]
    aux_layer_ids = spec.aux_layer_ids or default_aux_layer_ids(num_layers)
    if sorted(aux_layer_ids) != aux_layer_ids or not all(0 <= i < num_layers for i in aux_layer_ids):
        raise SubmitError(f"aux_layer_ids {aux_layer_ids}: must be increasing ids in [0, {num_layers})")

    samples: list[TokenizedSample] = []
    rejected: list[RejectedSample] = []
    for item in read_dataset(read_dataset_lines(spec.dataset_url, settings)):
        try:
            if isinstance(item, InvalidRecord):
                raise item
            samples.append(tokenizer.tokenize(item, max_length=spec.max_length, length_policy=spec.length_policy))
        except InvalidRecord as exc:
            rejected.append(RejectedSample(sample_id=exc.sample_id, line=exc.line, field=exc.field, reason=exc.reason))
    if not samples:
        raise SubmitError(
            f"dataset {spec.dataset_url}: no usable sample ({len(rejected)} rejected, e.g. {first_rejection(rejected)})"
        )

    per_token = bytes_per_token(hidden_size, spec.storage_dtype)
    tokens_total = sum(s.num_tokens for s in samples)
    projected = tokens_total * per_token + len(samples) * PER_SAMPLE_OVERHEAD_BYTES
    if settings.storage_budget_bytes is not None and projected > settings.storage_budget_bytes:
        raise OverBudget(
            f"job would store about {projected / 1e9:.2f} GB ({tokens_total} tokens x {per_token} bytes/token) "
            f"but the storage budget is {settings.storage_budget_bytes / 1e9:.2f} GB (EAGLE3_STORAGE_BUDGET_BYTES)"
        )

    target_vocab = tokenizer.vocab_size
    mapping = build_vocab_mapping(
        count_loss_tokens(samples),
        target_vocab_size=target_vocab,
        draft_vocab_size=min(spec.draft_vocab_size, target_vocab),
    )
    plan = plan_shards(samples, spec.shard_token_budget)
    mapping_bytes = vocab_mapping_bytes(mapping)

    job = JobRecord(
        job_id=job_id,
        created_at=utc_now(),
        spec=spec.model_copy(update={"job_id": job_id, "model_path": str(model_path), "aux_layer_ids": aux_layer_ids}),
        model=ModelRecord(
            path=str(model_path),
            architecture=(model_config.get("architectures") or ["unknown"])[0],
            num_hidden_layers=num_layers,
            hidden_size=hidden_size,
            vocab_size=target_vocab,
            template_hash=tokenizer.template_hash,
        ),
        aux_layer_ids=aux_layer_ids,
        hidden_size=hidden_size,
        bytes_per_token=per_token,
        samples_total=len(samples),
        samples_rejected=len(rejected),
        samples_truncated=sum(s.truncated for s in samples),
        tokens_total=tokens_total,
        loss_tokens_total=sum(sum(s.loss_mask) for s in samples),
        shards_total=len(plan),
        projected_bytes=projected,
        draft_vocab_size=mapping.draft_vocab_size,
        vocab_coverage=mapping.coverage,
        versions={"eagle3": shared.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
        provenance=compute_provenance(
            model_path,
            chat_template_sha256=tokenizer.template_hash,
            aux_layer_ids=aux_layer_ids,
            dtype="bfloat16",  # what every inference server returns (shared/shard_format.py HIDDEN_DTYPE)
            storage_dtype=spec.storage_dtype,
            vocab_mapping=mapping_bytes,
        ),
    )

    storage.put(layout.vocab_mapping(job_id), mapping_bytes)
    storage.put(layout.rejected(job_id), "".join(r.model_dump_json() + "\n" for r in rejected).encode())
    sample_index = 0
    for shard_index, members in enumerate(plan):
        shard = ShardInput(job_id=job_id, shard_index=shard_index, samples=[])
        for member in members:
            s = samples[member]
            shard.samples.append(
                SampleInput(
                    sample_index=sample_index,
                    sample_id=s.sample_id,
                    line=s.line,
                    input_ids=s.input_ids,
                    loss_mask=s.loss_mask,
                    truncated=s.truncated,
                )
            )
            sample_index += 1
        storage.put(layout.shard_input(job_id, shard_index), shard.model_dump_json().encode())
    publish_job(storage, client, job, num_shards=len(plan), enqueue=enqueue)
    logger.info(
        "submitted job=%s samples=%d rejected=%d tokens=%d shards=%d in %.1fs",
        job_id,
        len(samples),
        len(rejected),
        tokens_total,
        len(plan),
        time.monotonic() - started,
    )
    return job


def publish_job(storage: Storage, client: redis.Redis, job: JobRecord, *, num_shards: int, enqueue: Enqueue) -> None:
    """After every plan file: job.json (create-only; a job whose job.json exists is fully planned), its progress
    counters, then one task per shard."""
    if not storage.put_if_absent(layout.job_json(job.job_id), job.model_dump_json(indent=2).encode()):
        raise SubmitError(f"job {job.job_id} was created concurrently by another submit")
    progress.register_job(client, job, storage.url)
    for shard_index in range(num_shards):
        enqueue(job.job_id, shard_index)


def first_rejection(rejected: list[RejectedSample]) -> str:
    return f"line {rejected[0].line}: {rejected[0].field}: {rejected[0].reason}" if rejected else "empty dataset"


def load_job(storage: Storage, job_id: str) -> JobRecord:
    try:
        return JobRecord.model_validate_json(storage.get(layout.job_json(job_id)))
    except ObjectNotFound as exc:
        raise JobNotFound(job_id) from exc


def load_shard_input(storage: Storage, job_id: str, shard_index: int) -> ShardInput:
    return ShardInput.model_validate_json(storage.get(layout.shard_input(job_id, shard_index)))


def resume(job_id: str, *, storage: Storage, client: redis.Redis, enqueue: Enqueue) -> list[int]:
    """Re-enqueue every shard without a manifest (dead-lettered ones included) after recounting from storage."""
    job = load_job(storage, job_id)
    if not client.exists(progress.job_key(job_id)):
        progress.register_job(client, job, storage.url)
    client.hdel(progress.job_key(job_id), "cancelled")
    progress.rebuild(client, storage, job)
    committed = {layout.shard_index_from_manifest_key(k) for k in storage.list(layout.manifests_prefix(job_id))}
    pending = [k for k in range(job.shards_total) if k not in committed]
    for shard_index in pending:
        if storage.exists(layout.dead_letter(job_id, shard_index)):
            shard = load_shard_input(storage, job_id, shard_index)
            progress.forget_dead_letter(
                client, job_id, shard_index, num_samples=len(shard.samples), num_tokens=shard.num_tokens
            )
            storage.delete(layout.dead_letter(job_id, shard_index))
        enqueue(job_id, shard_index)
    logger.info("resumed job=%s pending_shards=%d", job_id, len(pending))
    return pending
