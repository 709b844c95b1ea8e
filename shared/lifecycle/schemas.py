"""Everything that crosses a process boundary: job specs, job records, shard inputs, manifests, progress."""

from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from shared.access import JOB_ID_PATTERN
from shared.provenance import Provenance
from shared.storage.dtypes import StorageDtype

LengthPolicy = Literal["truncate", "reject"]
# paused: the job cannot go on until something outside it changes (storage full); Progress.paused_reason says what.
# deleting: a delete has begun and not finished (shared/lifecycle/deletion.py); running `eagle3 delete` again ends it.
ReasoningPolicy = Literal["keep", "drop"]
JobState = Literal["queued", "running", "paused", "completed", "completed_with_errors", "cancelled", "deleting"]


def utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


# job.json and what it holds refuse a key they do not know rather than drop it: a field that a newer version or a kind
# wrote, or a typo in a submit (the API answers 422 naming it), would otherwise be lost without a word. No field of
# them was ever removed or renamed (git log -p -- shared/schemas.py shared/lifecycle/schemas.py; every one added since
# has a default), so every job.json written so far reads. One that goes away must be accepted and dropped explicitly.
JOB_JSON_CONFIG = ConfigDict(extra="forbid")


# The options of the kinds as the flat JobSpec of earlier versions held them, at the defaults it wrote into every
# job.json whatever the kind: a job.json written then still reads, without them, when its kind does not take them.
LEGACY_OPTION_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 2048,
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": -1,
    "seed": None,
    "reasoning": "keep",
    "conversations_per_shard": 64,
    "output_url": None,
    "then_extract": False,
    "then_train": False,
    "source_job_id": None,
    "audit_samples": None,
    "audit_fraction": None,
    "audit_backend_url": None,
    "audit_tolerance_aux": None,
    "audit_tolerance_final": None,
}


# What job.json held for every kind in earlier versions and now only the kind that has it records: read and dropped at
# this value when the job's kind declares no such field.
LEGACY_RECORD_DEFAULTS: dict[str, Any] = {"regeneration": None}


# Each registered job kind's options (KindOptions) and its own job.json fields (KindRecord), by kind name: filled by the
# registry (shared/lifecycle/kinds), which builds on these schemas, when it is imported; JobSpec checks a spec's kind
# and options against the first, JobRecord a record's own fields against the second.
KIND_OPTIONS: dict[str, type[BaseModel]] = {}
KIND_RECORDS: dict[str, type[BaseModel]] = {}


def _field_error(model: str, field: str, value: Any, kind: str, message: str) -> ValidationError:
    """A validation error of one field of a model, located at it like pydantic's own."""
    return ValidationError.from_exception_data(
        model, [InitErrorDetails(type=PydanticCustomError(kind, message), loc=(field,), input=value)]
    )


def _kind_fields(
    given: dict[str, Any], declared: type[BaseModel], legacy: dict[str, Any]
) -> tuple[dict[str, Any], list[str]]:
    """The extra keys of a spec or record that its kind's declaration names, without an earlier version's leftovers
    (another kind's field at the value every job.json then held), and the keys it does not name."""
    given = dict(given)
    for name, value in list(given.items()):
        if name not in declared.model_fields and legacy.get(name, ...) == value:
            del given[name]
    return given, sorted(set(given) - set(declared.model_fields))


class JobSpec(BaseModel):
    """What a user asks for. Recorded in job.json; every knob that changes the output is here: the fields below, common
    to every kind, and the options of the job's kind (its KindOptions, shared/lifecycle/kind.py) in the same flat
    object, checked against that declaration and recorded with their defaults."""

    # Extra keys are the kind's options: accepted only as far as its KindOptions declares them (checked below).
    model_config = ConfigDict(extra="allow")

    dataset_url: str | None = Field(
        default=None, description="file:///abs/data.jsonl, a local path, or s3://bucket/key.jsonl (an audit reads none)"
    )
    model_path: str | None = Field(
        default=None, description="local Hugging Face folder of the target; default EAGLE3_MODEL_PATH"
    )
    job_id: str | None = Field(default=None, pattern=JOB_ID_PATTERN, description="default: job-<time>-<random>")
    max_length: int = Field(default=2048, ge=8, description="tokens per sample")
    length_policy: LengthPolicy = Field(default="truncate", description="a longer sample is truncated or rejected")
    draft_vocab_size: int = Field(default=32000, ge=1, description="the drafter's vocabulary: the most frequent tokens")
    shard_token_budget: int = Field(default=16384, ge=1, description="prompt tokens per shard (one Celery task)")
    shard_seconds: float | None = Field(
        default=None,
        gt=0,
        description="size shards to this many seconds of one worker's measured rate (its last extraction shards); "
        "shard_token_budget until a shard was measured",
    )
    aux_layer_ids: list[int] | None = Field(default=None, min_length=3, max_length=3)
    storage_dtype: StorageDtype = Field(
        default="bfloat16",
        description="hidden states at rest: bfloat16 (SpecForge reads it) or fp8_e4m3 (about half the bytes)",
    )
    storage_budget_bytes: int | None = Field(
        default=None,
        ge=1,
        description="this job's own storage budget: refused at submit when projected above it, paused while running "
        "before a shard would cross it (`eagle3 budget --job` raises it)",
    )
    kind: str = Field(default="extract", description="extract, regenerate or audit: one of the registered job kinds")

    @model_validator(mode="after")
    def _check_kind_options(self) -> "JobSpec":
        if not KIND_OPTIONS:
            raise RuntimeError("no job kind is registered: import shared.lifecycle.kinds before reading a JobSpec")
        declared = KIND_OPTIONS.get(self.kind)
        if declared is None:
            known = ", ".join(sorted(KIND_OPTIONS))
            raise _field_error("JobSpec", "kind", self.kind, "unknown_kind", f"not one of {known}")
        given, unknown = _kind_fields(self.model_extra or {}, declared, LEGACY_OPTION_DEFAULTS)
        for name in unknown:
            message = f"not an option of jobs of kind {self.kind!r}"
            raise _field_error("JobSpec", name, given[name], "extra_forbidden", message)
        # The kind's own errors name their option as the common fields' do (the API's 422 points at it).
        options = declared.model_validate(given)
        # Recorded with their defaults, like the common fields: job.json says every knob that was in force.
        self.__pydantic_extra__ = options.model_dump()
        return self


class ModelRecord(BaseModel):
    model_config = JOB_JSON_CONFIG

    path: str
    architecture: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    template_hash: str


class JobRecord(BaseModel):
    """job.json: written once at submit, read by workers and the trainer. The fields below are every kind's; a kind
    records its own beside them in the same object (its KindRecord, shared/lifecycle/kind.py), checked against that
    declaration like a spec's options."""

    # Extra keys are the kind's own fields: accepted only as far as its KindRecord declares them (checked below).
    model_config = ConfigDict(extra="allow")

    job_id: str
    created_at: str
    spec: JobSpec
    model: ModelRecord
    aux_layer_ids: list[int]
    hidden_size: int
    dtype: str = "bfloat16"
    bytes_per_token: int
    samples_total: int
    samples_rejected: int
    samples_truncated: int
    tokens_total: int
    loss_tokens_total: int
    shards_total: int
    projected_bytes: int
    draft_vocab_size: int
    vocab_coverage: float
    versions: dict[str, str]
    provenance: Provenance | None = None  # what makes its hidden states comparable (shared/provenance.py)

    @property
    def kind(self) -> str:
        return self.spec.kind

    @model_validator(mode="after")
    def _check_kind_record(self) -> "JobRecord":
        declared = KIND_RECORDS[self.kind]  # the spec named a registered kind
        given, unknown = _kind_fields(self.model_extra or {}, declared, LEGACY_RECORD_DEFAULTS)
        for name in unknown:
            raise ValidationError.from_exception_data(
                "JobRecord", [InitErrorDetails(type="extra_forbidden", loc=(name,), input=given[name])]
            )
        self.__pydantic_extra__ = declared.model_validate(given).model_dump()
        return self


class SampleInput(BaseModel):
    sample_index: int
    sample_id: str
    line: int
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool = False


class ShardInput(BaseModel):
    """inputs/shard_{k}.json: the tokenized samples of one shard, so a task carries ids, not payloads."""

    job_id: str
    shard_index: int
    samples: list[SampleInput]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.input_ids) for s in self.samples)


class RejectedSample(BaseModel):
    sample_id: str
    line: int
    field: str
    reason: str


class ManifestSample(BaseModel):
    sample_index: int
    sample_id: str
    key: str
    num_tokens: int
    loss_tokens: int
    bytes: int
    sha256: str


class Manifest(BaseModel):
    """manifests/shard_{k}.json, written create-only and last: a shard exists iff its manifest exists.
    Build one with `Manifest.of`, which computes the totals from the samples."""

    job_id: str
    shard_index: int
    aux_layer_ids: list[int]
    hidden_size: int
    dtype: str
    samples: list[ManifestSample]
    num_samples: int
    num_tokens: int
    loss_tokens: int
    bytes: int
    # the server that captured: backend and version from /get_model_info (an audit says whether it recomputed with
    # another); empty in manifests written before it was recorded
    server: dict[str, Any] = Field(default_factory=dict)
    # Stamped by the shard lifecycle (shared/lifecycle/shards.py) just before the commit.
    worker: str = ""
    started_at: str = ""
    committed_at: str = ""
    timings_s: dict[str, float] = Field(default_factory=dict)

    @classmethod
    def of(cls, job: "JobRecord", shard_index: int, samples: list[ManifestSample], **stamps: Any) -> "Manifest":
        return cls(
            job_id=job.job_id,
            shard_index=shard_index,
            aux_layer_ids=job.aux_layer_ids,
            hidden_size=job.hidden_size,
            dtype=job.dtype,
            samples=samples,
            num_samples=len(samples),
            num_tokens=sum(s.num_tokens for s in samples),
            loss_tokens=sum(s.loss_tokens for s in samples),
            bytes=sum(s.bytes for s in samples),
            **stamps,
        )


class DeadLetter(BaseModel):
    job_id: str
    shard_index: int
    error_type: str
    reason: str
    retries: int
    worker: str
    at: str = Field(default_factory=utc_now)


class RegenerationProgress(BaseModel):
    """The regeneration side of a job's progress: counts of conversations, and the chain."""

    turns_done: int  # assistant turns regenerated, in committed shards
    max_generated_tokens: int  # the upper bound; Progress.tokens_total is the projection
    conversations_with_reasoning: int
    conversations_truncated: int  # some turn stopped at max_new_tokens
    conversations_empty: int  # some turn came back empty (after dropping reasoning, when dropped)
    conversations_failed: int  # recorded with their reason, not in the output
    finalized: bool  # the dataset is assembled (and the chained job submitted)
    output_key: str | None = None
    chained_job_id: str | None = None
    error: str | None = None  # why assembling or chaining failed


class Progress(BaseModel):
    """Token-weighted progress of one job; the same numbers in the API, the CLI and /metrics.

    For a regenerate job the tokens are generated tokens; tokens_total is then projected from the conversations
    done so far (at most assistant turns x max_new_tokens), and exact once the job is finished."""

    job_id: str
    state: JobState
    samples_total: int
    samples_done: int
    samples_rejected: int
    samples_failed: int
    tokens_total: int
    tokens_done: int
    tokens_failed: int
    shards_total: int
    shards_committed: int
    shards_dead_lettered: int
    shards_rerun: int = 0  # runs of a shard again after its worker died or lost its pool process
    bytes_stored: int
    bytes_per_token: float
    projected_total_bytes: int
    storage_budget_bytes: int | None
    budget_headroom_bytes: int | None
    tokens_per_second: float
    eta_seconds: float | None
    elapsed_seconds: float
    created_at: str
    kind: str = "extract"
    counters: dict[str, int] = Field(default_factory=dict)  # the kind's own counters (JobKind.counters), by name
    regeneration: RegenerationProgress | None = None
    paused_reason: str | None = None  # why a paused job waits, e.g. "storage full: ..."; None unless paused

    @property
    def finished(self) -> bool:
        return self.state in ("completed", "completed_with_errors", "cancelled")


# ----------------------------------------------------------------------------------------------------------
# Regeneration (docs/regeneration.md)


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ConversationInput(BaseModel):
    sample_index: int  # position among the job's accepted conversations: the output order
    sample_id: str
    line: int
    messages: list[ChatMessage]  # as read; the assistant contents are replaced


class RegenerationShardInput(BaseModel):
    """inputs/shard_{k}.json of a regenerate job: the conversations of one shard, in input order."""

    job_id: str
    shard_index: int
    conversations: list[ConversationInput]


class TurnRecord(BaseModel):
    """One regenerated assistant turn."""

    message_index: int  # where it sits in `messages`
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" or "length"
    reasoning: bool  # the text had reasoning (<think>...</think>, or the server's reasoning field)
    truncated: bool  # stopped at max_new_tokens (finish_reason "length")
    empty: bool  # nothing left once reasoning was handled


class ConversationResult(BaseModel):
    """conversations/rows_{g}-{g+2000}/conv_{i}.json, written create-only once a conversation is done (or failed),
    so that a retried or redelivered shard does not decode it again."""

    sample_index: int
    sample_id: str
    line: int
    messages: list[ChatMessage] | None  # the regenerated conversation; None when it failed
    turns: list[TurnRecord]
    error: str | None = None  # why it failed: the field and the reason
    failed_message_index: int | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def generated_tokens(self) -> int:
        return sum(t.completion_tokens for t in self.turns)


class ConversationEntry(BaseModel):
    """A conversation as its shard manifest lists it: where its record is, and how it went."""

    sample_index: int
    sample_id: str
    line: int
    key: str  # its ConversationResult
    turns: list[TurnRecord]
    generated_tokens: int
    error: str | None = None


class FailedConversation(BaseModel):
    sample_index: int
    sample_id: str
    line: int
    reason: str
    shard_index: int


class RegenerationManifest(BaseModel):
    """manifests/shard_{k}.json of a regenerate job, written create-only and last, like an extraction manifest.
    num_samples counts the conversations written to the shard's output, num_tokens their generated tokens."""

    job_id: str
    shard_index: int
    kind: Literal["regenerate"] = "regenerate"
    model: str  # model_path as the inference server reports it
    server: dict[str, Any]  # backend, version (and sglang_version) from /get_model_info
    sampling_params: dict[str, Any]
    reasoning: ReasoningPolicy
    output_key: str  # this shard's JSONL, in input order
    sha256: str
    conversations: list[ConversationEntry]  # every conversation of the shard, failed ones with their reason
    num_samples: int
    num_tokens: int
    bytes: int
    counters: dict[str, int]  # added to the job's Redis counters when the shard is counted
    # Stamped by the shard lifecycle (shared/lifecycle/shards.py) just before the commit.
    worker: str = ""
    started_at: str = ""
    committed_at: str = ""
    timings_s: dict[str, float] = Field(default_factory=dict)
