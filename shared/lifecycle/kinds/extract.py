"""Extraction: every sample's hidden states captured by the inference server, validated and committed.

- plan: each conversation tokenized with the target's chat template (assistant-only loss mask), the draft vocabulary
  built from the loss tokens, consecutive samples grouped into shards of about `shard_token_budget` tokens;
- a shard: capture every pending sample, validate it, write its .pt file create-only (captures and writes overlap),
  then describe the shard in a manifest. All or nothing: a failed shard leaves none of the files it created.
"""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

from shared.data.datasets import Conversation
from shared.data.tokenization import TokenizedSample
from shared.errors import ShardValidationError
from shared.lifecycle.command import EXTRACTION_OPTIONS, KindCommand
from shared.lifecycle.kind import JobKind, JobPlan, KindOptions, KindRecord, ShardContext, Target, check_served_model
from shared.lifecycle.schemas import JobRecord, JobSpec, Manifest, ManifestSample, SampleInput, ShardInput
from shared.provenance import compute_provenance
from shared.settings import Settings
from shared.storage import layout
from shared.storage.dtypes import StorageDtype
from shared.storage.objects import ObjectDigest, Storage

# The registry of kinds, which the command line reads, must not load torch: what loads it (the capture client and
# protocol, the vocabulary, the sample format) is imported where the work needs it.
if TYPE_CHECKING:
    from shared.capture.client import InferenceClient
    from shared.capture.protocol import CapturedStates

# torch.save's zip container and the int64 input_ids/loss_mask add a little to the raw bf16 bytes.
PER_SAMPLE_OVERHEAD_BYTES = 1536


def bytes_per_token(hidden_size: int, storage_dtype: StorageDtype = "bfloat16") -> int:
    # 3 aux + 1 final state in bf16, plus int64 input_ids and loss_mask; fp8 adds 4 float32 scales (shard_format.py).
    if storage_dtype == "fp8_e4m3":
        return 4 * hidden_size * 1 + 4 * 4 + 2 * 8
    return 4 * hidden_size * 2 + 2 * 8


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


def describe_sample(sample: SampleInput, key: str, data: bytes) -> ManifestSample:
    """A sample file's manifest entry: where it is, its token counts, size and sha256."""
    return describe_stored(sample, key, ObjectDigest.of(data))


def describe_stored(sample: SampleInput, key: str, digest: ObjectDigest) -> ManifestSample:
    """The manifest entry of a sample file whose size and sha256 are known (hashed while it was written)."""
    return ManifestSample(
        sample_index=sample.sample_index,
        sample_id=sample.sample_id,
        key=key,
        num_tokens=len(sample.input_ids),
        loss_tokens=sum(sample.loss_mask),
        bytes=digest.size_bytes,
        sha256=digest.sha256,
    )


def commit_sample(
    storage: Storage, job: JobRecord, shard_index: int, sample: SampleInput, states: CapturedStates
) -> tuple[ManifestSample, bool]:
    """Validate, encode, hash and write one sample file create-only; True if this call created it.
    Runs in the writer pool, so the next captures keep arriving while this one is written. torch.save's output
    streams into the file and is hashed on the way: no 64 MB copy in memory, no second pass to hash it."""
    from shared.storage.sample_format import InvalidCapture, validate_capture, write_sample

    try:
        validate_capture(
            states.aux_hidden_state, states.hidden_state, num_tokens=len(sample.input_ids), hidden_size=job.hidden_size
        )
    except InvalidCapture as exc:
        raise ShardValidationError(job.job_id, shard_index, sample.sample_id, exc.field, exc.reason) from exc
    key = layout.sample(job.job_id, sample.sample_index)
    digest = storage.put_if_absent_from(
        key,
        lambda out: write_sample(
            out,
            sample.input_ids,
            sample.loss_mask,
            states.aux_hidden_state,
            states.hidden_state,
            storage_dtype=job.spec.storage_dtype,
        ),
    )
    if digest is not None:
        return describe_stored(sample, key, digest), True
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


class Extract(JobKind[ShardInput, SampleInput, ManifestSample, Manifest]):
    name = "extract"
    options = KindOptions  # JobSpec's common fields are an extraction's
    record = KindRecord  # JobRecord's common fields are all it records
    finalizes = False
    input_type = ShardInput
    manifest_type = Manifest
    command = KindCommand(
        name="submit",
        help="submit an extraction job to the producer API",
        common_options=EXTRACTION_OPTIONS,
        watch_help="show a live progress bar until the job finishes",
    )

    def accept(self, record: Conversation, spec: JobSpec, target: Target) -> TokenizedSample:
        return target.tokenizer.tokenize(record, max_length=spec.max_length, length_policy=spec.length_policy)

    def plan(self, job_id: str, spec: JobSpec, target: Target, accepted: list[TokenizedSample]) -> JobPlan[ShardInput]:
        from shared.data.vocab import build_vocab_mapping, count_loss_tokens, vocab_mapping_bytes

        items = accepted
        per_token = bytes_per_token(target.hidden_size, spec.storage_dtype)
        tokens_total = sum(s.num_tokens for s in items)
        target_vocab = target.vocab_size
        mapping = build_vocab_mapping(
            count_loss_tokens(items),
            target_vocab_size=target_vocab,
            draft_vocab_size=min(spec.draft_vocab_size, target_vocab),
        )
        shards: list[ShardInput] = []
        for shard_index, members in enumerate(plan_shards(items, spec.shard_token_budget)):
            samples = [
                SampleInput(
                    sample_index=member,
                    sample_id=items[member].sample_id,
                    line=items[member].line,
                    input_ids=items[member].input_ids,
                    loss_mask=items[member].loss_mask,
                    truncated=items[member].truncated,
                )
                for member in members
            ]
            shards.append(ShardInput(job_id=job_id, shard_index=shard_index, samples=samples))
        mapping_bytes = vocab_mapping_bytes(mapping)
        return JobPlan(
            shards=shards,
            samples_total=len(items),
            tokens_total=tokens_total,
            bytes_per_token=per_token,
            projected_bytes=tokens_total * per_token + len(items) * PER_SAMPLE_OVERHEAD_BYTES,
            record={
                "samples_truncated": sum(s.truncated for s in items),
                "loss_tokens_total": sum(sum(s.loss_mask) for s in items),
                "draft_vocab_size": mapping.draft_vocab_size,
                "vocab_coverage": mapping.coverage,
                "provenance": compute_provenance(
                    target.path,
                    chat_template_sha256=target.tokenizer.template_hash,
                    aux_layer_ids=target.aux_layer_ids,
                    dtype="bfloat16",  # what every inference server returns (sample_format.HIDDEN_DTYPE)
                    storage_dtype=spec.storage_dtype,
                    vocab_mapping=mapping_bytes,
                ),
            },
            files={layout.vocab_mapping(job_id): mapping_bytes},
        )

    def open(self, settings: Settings) -> InferenceClient:
        from shared.capture.client import InferenceClient

        return InferenceClient.from_settings(settings)

    def prepare(self, ctx: ShardContext, state: InferenceClient, job: JobRecord) -> dict[str, str]:
        """The server checked, and named (backend, version) for the shard's manifest."""
        # A GPU server answers 503 for minutes while it compiles kernels; that is a wait, not a failure.
        state.wait_ready(ctx.settings.inference_ready_timeout_s)
        info = state.model_info()
        check_served_model(job, info, state.base_url, capture=True)
        return {"backend": info.backend, "version": info.version}

    def items(self, shard: ShardInput) -> list[SampleInput]:
        return shard.samples

    def item_key(self, job_id: str, item: SampleInput) -> str:
        return layout.sample(job_id, item.sample_index)

    def reuse(self, item: SampleInput, key: str, data: bytes) -> ManifestSample:
        return describe_sample(item, key, data)

    def process(
        self,
        ctx: ShardContext,
        state: InferenceClient,
        prepared: dict[str, str],
        job: JobRecord,
        shard: ShardInput,
        pending: list[SampleInput],
        done: dict[int, ManifestSample],
    ) -> Manifest:
        started = time.monotonic()
        written = capture_and_write(
            ctx.storage, job, shard.shard_index, pending, state, write_concurrency=ctx.settings.write_concurrency
        )
        entries = done | {entry.sample_index: entry for entry in written}
        samples = [entries[s.sample_index] for s in shard.samples]
        return Manifest.of(
            job,
            shard.shard_index,
            samples,
            server=prepared,
            timings_s={"capture_and_write": round(time.monotonic() - started, 4)},
        )

    def shard_size(self, shard: ShardInput) -> tuple[int, int]:
        return len(shard.samples), shard.num_tokens
