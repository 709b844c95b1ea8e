"""Regeneration (docs/regeneration.md): every assistant turn of a dataset rewritten by the target itself, so that
the drafter learns the target's own distribution rather than human answers.

- plan: the dataset read with the extraction's rules (same rejections, same messages), the target's tokenizer saved
  next to the job (workers render prompts with it), shards of `conversations_per_shard` conversations;
- a shard: each conversation decoded turn by turn through the inference server's `/generate` (the prompt of an
  assistant turn is the regenerated history rendered with the chat template plus the generation prompt), the
  conversations of a shard concurrently so that the server batches them. Each finished (or failed) conversation is
  written create-only, then the shard's JSONL, then its manifest, and the shard counts its generated tokens;
- after the last commit: `{job}/regenerated.jsonl` is assembled (create-only) and, with `then_extract`, the producer
  is asked to submit the extraction job on it (deterministic id, so idempotent).
"""

import hashlib
import json
import logging
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import httpx
import redis
from pydantic import BaseModel, ConfigDict, Field, model_validator
from redis.typing import EncodableT, FieldT

from shared import access
from shared.data.datasets import Conversation, InvalidRecord, Message
from shared.data.tokenization import ChatTokenizer
from shared.errors import (
    ConfigurationError,
    Eagle3Error,
    InferenceProtocolError,
    ProducerUnavailable,
    SubmitError,
)
from shared.lifecycle import progress
from shared.lifecycle.command import EXTRACTION_OPTIONS, CommandSession, KindCommand
from shared.lifecycle.kind import (
    JobKind,
    JobPlan,
    KindOptions,
    KindRecord,
    RecentJobs,
    ShardContext,
    Target,
    check_served_model,
    dead_lettered_samples,
)
from shared.lifecycle.schemas import (
    ChatMessage,
    ConversationEntry,
    ConversationInput,
    ConversationResult,
    FailedConversation,
    JobRecord,
    JobSpec,
    ReasoningPolicy,
    RegenerationManifest,
    RegenerationProgress,
    RegenerationShardInput,
    TurnRecord,
    utc_now,
)
from shared.lifecycle.shards import Cancelled
from shared.settings import Settings
from shared.storage import layout, locations
from shared.storage.objects import Storage

# The registry of kinds, which the command line reads, must not load torch: the capture client and protocol, which
# load it, are imported where the work needs them.
if TYPE_CHECKING:
    from shared.capture.client import InferenceClient
    from shared.capture.protocol import ModelInfo

logger = logging.getLogger(__name__)


class RegenerateOptions(KindOptions):
    """A regenerate job's options (docs/regeneration.md): how the target rewrites every assistant turn. JobSpec's
    extraction fields then apply to the chained extraction job (then_extract)."""

    max_new_tokens: int = Field(default=2048, ge=1, description="per regenerated assistant turn")
    temperature: float = Field(default=0.0, ge=0.0, description="0 is greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, description="-1 keeps the whole vocabulary")
    seed: int | None = Field(default=None, description="sampling seed (each turn its own, derived)")
    reasoning: ReasoningPolicy = Field(default="keep", description="keep or drop <think>...</think> text")
    conversations_per_shard: int = Field(default=64, ge=1, description="conversations per regeneration shard")
    output_url: str | None = Field(
        default=None, description="also write the regenerated dataset here (under the dataset roots, or s3://)"
    )
    then_extract: bool = Field(default=False, description="submit an extraction job on the regenerated dataset")
    then_train: bool = Field(
        default=False,
        description="train on the chained extraction job (implies then_extract): `eagle3 train --job <this job>`",
    )

    @model_validator(mode="after")
    def _check(self) -> "RegenerateOptions":
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (whole vocabulary) or >= 1, got {self.top_k}")
        if self.then_train:
            self.then_extract = True
        return self


class RegenerationPlan(BaseModel):
    """What a regenerate job will produce, recorded in its job.json at submit."""

    model_config = ConfigDict(extra="forbid")

    assistant_turns_total: int
    max_generated_tokens: int  # assistant turns x max_new_tokens: the upper bound of the work
    sampling_params: dict[str, Any]  # what every /generate request carries (seed: per turn, derived)
    output_key: str  # the assembled dataset, relative to the storage root
    output_url: str | None = None
    chained_job_id: str | None = None  # the extraction job submitted when all shards are committed
    tokenizer_prefix: str  # the target's tokenizer and chat template, for the workers


class RegenerateRecord(KindRecord):
    """A regenerate job's own fields of job.json."""

    regeneration: RegenerationPlan

    @classmethod
    def plan_of(cls, job: JobRecord) -> RegenerationPlan:
        return cls.of(job).regeneration


# A rough size of one generated token in the output JSONL, for the projected bytes before anything is stored.
OUTPUT_BYTES_PER_TOKEN = 5
# How often a trainer that waits for a regenerate job's chained extraction job looks for it.
CHAIN_POLL_S = 5.0
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

ChainSubmit = Callable[[JobSpec], str]  # submits the chained extraction job, returns its id


class ConversationFailed(Eagle3Error):
    """One turn of one conversation cannot be regenerated; the conversation is recorded with this reason."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


# ----------------------------------------------------------------------------------------------------------
# Reasoning text


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, answer) of a generated text. Handles `<think>...</think>answer`, a template that opened the think
    block in the prompt (`...</think>answer`), and a generation cut off inside the block (`<think>...`)."""
    close = text.find(THINK_CLOSE)
    if close >= 0:
        before, answer = text[:close], text[close + len(THINK_CLOSE) :]
        open_ = before.find(THINK_OPEN)
        reasoning = before[open_ + len(THINK_OPEN) :] if open_ >= 0 else before
        prefix = before[:open_] if open_ >= 0 else ""
        return reasoning, prefix + answer
    open_ = text.find(THINK_OPEN)
    if open_ >= 0:
        return text[open_ + len(THINK_OPEN) :], text[:open_]
    return None, text


def apply_reasoning(text: str, reasoning_field: str | None, policy: ReasoningPolicy) -> tuple[str, bool]:
    """(assistant content, whether the turn had reasoning). `keep` keeps the reasoning as a think block in the
    content (where a server returned it separately, it is put in front the way reasoning templates render it);
    `drop` removes it and the whitespace after it."""
    reasoning, answer = split_reasoning(text)
    if reasoning_field:
        if policy == "keep":
            return f"{THINK_OPEN}\n{reasoning_field.strip()}\n{THINK_CLOSE}\n\n{text.lstrip()}", True
        return answer.lstrip() if reasoning is not None else text, True
    if reasoning is None:
        return text, False
    return (text if policy == "keep" else answer.lstrip()), True


# ----------------------------------------------------------------------------------------------------------
# The target's tokenizer, shared with the workers through storage


def tokenizer_files(job_id: str, tokenizer: ChatTokenizer) -> dict[str, bytes]:
    """The tokenizer files (chat template included) under {job}/tokenizer/: workers need not mount the model."""
    with tempfile.TemporaryDirectory(prefix="eagle3-tokenizer-") as tmp:
        tokenizer.tokenizer.save_pretrained(tmp)
        return {
            layout.tokenizer_prefix(job_id) + path.relative_to(tmp).as_posix(): path.read_bytes()
            for path in sorted(Path(tmp).rglob("*"))
            if path.is_file()
        }


class PromptRenderer:
    """A job's ChatTokenizer behind a lock: a fast tokenizer shared by threads can fail with "Already borrowed"."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self.tokenizer = tokenizer
        self._lock = threading.Lock()

    def prompt(self, conv: Conversation, messages: list[ChatMessage]) -> list[int]:
        with self._lock:
            return self.tokenizer.generation_prompt(conv, [Message(m.role, m.content) for m in messages])

    def decode(self, output_ids: list[int]) -> str:
        """Text of generated ids, as a server decodes it (SGLang launched with --skip-tokenizer-init sends none)."""
        with self._lock:
            # One sequence decodes to one str; transformers types the batch form (a list of them) too.
            return cast(str, self.tokenizer.tokenizer.decode(output_ids, skip_special_tokens=True))


class TokenizerCache:
    """Per worker process: the tokenizers of the jobs it ran shards of last (RecentJobs), each loaded once from the
    files the job keeps in storage. The files go to a temporary folder that is removed once they are loaded, so
    neither the process's memory nor its disk grows with the jobs it runs."""

    def __init__(self) -> None:
        self._renderers: RecentJobs[PromptRenderer] = RecentJobs()
        self._lock = threading.Lock()

    def get(self, storage: Storage, job: JobRecord) -> PromptRenderer:
        with self._lock:
            return self._renderers.get(job.job_id, lambda: PromptRenderer(self._load(storage, job)))

    def _load(self, storage: Storage, job: JobRecord) -> ChatTokenizer:
        prefix = layout.tokenizer_prefix(job.job_id)
        keys = storage.list(prefix)
        if not keys:
            raise ConfigurationError(f"job {job.job_id}: no tokenizer files under {prefix} in {storage.url}")
        with tempfile.TemporaryDirectory(prefix="eagle3-tokenizer-") as tmp:
            for key in keys:
                path = Path(tmp) / key.removeprefix(prefix)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(storage.get(key))
            tokenizer = ChatTokenizer.from_pretrained(tmp)  # a fast tokenizer: read whole, the files not kept open
        if tokenizer.template_hash != job.model.template_hash:
            raise ConfigurationError(
                f"job {job.job_id}: the stored tokenizer's chat template hashes to {tokenizer.template_hash}, "
                f"the job was planned with {job.model.template_hash}"
            )
        return tokenizer


# ----------------------------------------------------------------------------------------------------------
# Planning


def sampling_params(spec: JobSpec) -> dict[str, Any]:
    """The sampling_params of every /generate request of a job (max_new_tokens may shrink to fit the context)."""
    options = RegenerateOptions.of(spec)
    if options.temperature == 0:
        return {"max_new_tokens": options.max_new_tokens, "temperature": 0.0}
    return {
        "max_new_tokens": options.max_new_tokens,
        "temperature": options.temperature,
        "top_p": options.top_p,
        "top_k": options.top_k,
    }


def turn_seed(seed: int, sample_index: int, message_index: int) -> int:
    """A seed of its own per turn: the same job gives the same text, whichever worker or batch decodes it."""
    digest = hashlib.sha256(f"{seed}/{sample_index}/{message_index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def plan_conversation_shards(num_conversations: int, per_shard: int) -> list[range]:
    return [range(start, min(start + per_shard, num_conversations)) for start in range(0, num_conversations, per_shard)]


# ----------------------------------------------------------------------------------------------------------
# One conversation


def _parse_answer(answer: Any, where: str, renderer: PromptRenderer) -> tuple[str, str | None, int, dict[str, Any]]:
    """(text, reasoning returned separately or None, completion tokens, finish_reason) of a /generate answer."""
    output_ids = answer.get("output_ids") if isinstance(answer, dict) else None
    text = answer.get("text") if isinstance(answer, dict) else None
    if not isinstance(text, str):
        if not isinstance(output_ids, list) or not all(isinstance(t, int) for t in output_ids):
            raise InferenceProtocolError(f"{where}: not a /generate answer (no text, no output_ids): {answer!r:.300}")
        text = renderer.decode(output_ids)
    assert isinstance(answer, dict)
    meta_info = answer.get("meta_info") or {}
    finish = meta_info.get("finish_reason")
    if not isinstance(finish, dict) or "type" not in finish:
        raise InferenceProtocolError(f"{where}: answer without meta_info.finish_reason: {answer!r:.300}")
    if finish["type"] not in ("stop", "length"):
        # SGLang aborts a request it cannot serve (e.g. longer than its context) with a message.
        raise ConversationFailed(where, f"the server ended it with {finish}")
    completion_tokens = meta_info.get("completion_tokens", len(output_ids or []))
    reasoning = answer.get("reasoning_content") or meta_info.get("reasoning_content")
    return text, reasoning if isinstance(reasoning, str) else None, int(completion_tokens), finish


def regenerate_conversation(
    conv: ConversationInput,
    *,
    job: JobRecord,
    renderer: PromptRenderer,
    inference: "InferenceClient",
    max_context_length: int,
    is_cancelled: Callable[[], bool] = lambda: False,
) -> ConversationResult:
    """Each assistant turn, in order, decoded given the regenerated history; user and system turns unchanged.
    A turn the server refuses (4xx), an abort, or a prompt with no room left in the context fails the conversation
    with the reason; outages (InferenceUnavailable) propagate, so that the shard is retried."""
    spec, options = job.spec, RegenerateOptions.of(job.spec)
    source = Conversation(sample_id=conv.sample_id, line=conv.line)  # names the record in errors
    attempt = uuid.uuid4().hex[:8]
    messages: list[ChatMessage] = []
    turns: list[TurnRecord] = []
    for index, message in enumerate(conv.messages):
        if message.role != "assistant":
            messages.append(message)
            continue
        if is_cancelled():
            raise Cancelled(f"job {job.job_id} cancelled")
        where = f"messages[{index}]"
        try:
            prompt = renderer.prompt(source, messages)
            room = max_context_length - len(prompt)
            if room < 1:
                raise ConversationFailed(
                    where,
                    f"prompt of {len(prompt)} tokens leaves no room to generate within the server's "
                    f"max_context_length {max_context_length}",
                )
            params = {**sampling_params(spec), "max_new_tokens": min(options.max_new_tokens, room)}
            if options.seed is not None and options.temperature > 0:
                params["sampling_seed"] = turn_seed(options.seed, conv.sample_index, index)
            rid = f"{job.job_id}/{conv.sample_index}/{index}/{attempt}"
            answer = inference.generate(input_ids=prompt, sampling_params=params, rid=rid)
            text, reasoning_field, completion_tokens, finish = _parse_answer(answer, where, renderer)
        except (InferenceProtocolError, InvalidRecord, ConversationFailed) as exc:
            reason = str(exc) if isinstance(exc, ConversationFailed) else f"{where}: {exc}"
            if isinstance(exc, InvalidRecord):
                reason = f"{exc.field}: {exc.reason}"
            return ConversationResult(
                sample_index=conv.sample_index,
                sample_id=conv.sample_id,
                line=conv.line,
                messages=None,
                turns=turns,
                error=reason,
                failed_message_index=index,
            )
        content, had_reasoning = apply_reasoning(text, reasoning_field, options.reasoning)
        turns.append(
            TurnRecord(
                message_index=index,
                prompt_tokens=len(prompt),
                completion_tokens=completion_tokens,
                finish_reason=finish["type"],
                reasoning=had_reasoning,
                truncated=finish["type"] == "length",
                empty=not content.strip(),
            )
        )
        messages.append(ChatMessage(role="assistant", content=content))
    return ConversationResult(
        sample_index=conv.sample_index, sample_id=conv.sample_id, line=conv.line, messages=messages, turns=turns
    )


def output_line(result: ConversationResult) -> str:
    """One line of the regenerated dataset: OpenAI messages, with the input record's id (or line-N)."""
    assert result.messages is not None
    record = {"id": result.sample_id, "messages": [m.model_dump() for m in result.messages]}
    return json.dumps(record, ensure_ascii=False) + "\n"


def _entry(result: ConversationResult, key: str) -> ConversationEntry:
    return ConversationEntry(
        sample_index=result.sample_index,
        sample_id=result.sample_id,
        line=result.line,
        key=key,
        turns=result.turns,
        generated_tokens=result.generated_tokens,
        error=result.error,
    )


# The regenerate kind's own counters in its jobs' progress (JobKind.counters), each with what it counts. A regenerate
# job's samples are conversations and its tokens generated tokens; these count its conversations and turns.
REGENERATION_COUNTERS = {
    "turns_done": "Assistant turns regenerated",
    "conversations_with_reasoning": "Regenerated conversations with reasoning text",
    "conversations_truncated": "Regenerated conversations with a turn cut at max_new_tokens",
    "conversations_empty": "Regenerated conversations with an empty turn",
    "conversations_failed": "Conversations that failed, recorded with their reason",
}


def shard_counters(results: list[ConversationResult]) -> dict[str, int]:
    """What a committed shard adds to the job's counters (REGENERATION_COUNTERS, and progress's samples_failed)."""
    ok = [r for r in results if not r.failed]
    failed = len(results) - len(ok)
    return {
        "turns_done": sum(len(r.turns) for r in ok),
        "conversations_with_reasoning": sum(any(t.reasoning for t in r.turns) for r in ok),
        "conversations_truncated": sum(any(t.truncated for t in r.turns) for r in ok),
        "conversations_empty": sum(any(t.empty for t in r.turns) for r in ok),
        "conversations_failed": failed,
        "samples_failed": failed,
    }


# ----------------------------------------------------------------------------------------------------------
# The last shard: assemble the dataset, chain the extraction


def load_manifests(storage: Storage, job_id: str) -> list[RegenerationManifest]:
    return sorted(
        (
            RegenerationManifest.model_validate_json(storage.get(key))
            for key in storage.list(layout.manifests_prefix(job_id))
        ),
        key=lambda m: m.shard_index,
    )


def failed_conversations(storage: Storage, job_id: str) -> list[FailedConversation]:
    """Every conversation that is not in the output, with its reason: failed turns of committed shards, and every
    conversation of a dead-lettered shard."""
    failed = [
        FailedConversation(
            sample_index=c.sample_index, sample_id=c.sample_id, line=c.line, reason=c.error, shard_index=m.shard_index
        )
        for m in load_manifests(storage, job_id)
        for c in m.conversations
        if c.error is not None
    ]
    failed += dead_lettered_samples(Regenerate(), storage, job_id)
    return sorted(failed, key=lambda f: f.sample_index)


def summarize(job: JobRecord, manifests: list[RegenerationManifest]) -> dict[str, Any]:
    conversations = [c for m in manifests for c in m.conversations]
    ok = [c for c in conversations if c.error is None]
    turns = [t for c in ok for t in c.turns]
    return {
        "job_id": job.job_id,
        "model": manifests[0].model if manifests else job.model.path,
        "server": manifests[0].server if manifests else {},
        "sampling_params": manifests[0].sampling_params if manifests else {},
        "reasoning": RegenerateOptions.of(job.spec).reasoning,
        "conversations_total": job.samples_total,
        "conversations_rejected": job.samples_rejected,
        "conversations_written": len(ok),
        "conversations_failed": len(conversations) - len(ok),
        "conversations_with_reasoning": sum(any(t.reasoning for t in c.turns) for c in ok),
        "conversations_truncated": sum(any(t.truncated for t in c.turns) for c in ok),
        "conversations_empty": sum(any(t.empty for t in c.turns) for c in ok),
        "turns": len(turns),
        "turns_with_reasoning": sum(t.reasoning for t in turns),
        "turns_truncated": sum(t.truncated for t in turns),
        "turns_empty": sum(t.empty for t in turns),
        "generated_tokens": sum(c.generated_tokens for c in ok),
        "output_key": layout.regenerated_dataset(job.job_id),
    }


def projected_generated_tokens(number: Mapping[str, int], *, finished: bool) -> int:
    """A regenerate job's total generated tokens: what the conversations done so far generated on average, times
    all of them, at most assistant turns x max_new_tokens (the planned tokens_total); exact once finished."""
    done, upper = number["tokens_done"], number["tokens_total"]
    if finished:
        return done
    conversations_done = number["samples_done"] + number.get("conversations_failed", 0)
    if conversations_done == 0:
        return upper
    remaining = max(number["samples_total"] - conversations_done - _dead_conversations(number), 0)
    per_conversation = done / conversations_done
    return min(upper, round(done + per_conversation * remaining))


def _dead_conversations(number: Mapping[str, int]) -> int:
    # samples_failed holds the failed conversations of committed shards plus every conversation of a dead shard.
    return number["samples_failed"] - number.get("conversations_failed", 0)


def chained_spec(job: JobRecord, storage: Storage) -> JobSpec:
    """The extraction job on the regenerated dataset, with the extraction knobs of the regenerate job's spec."""
    plan = RegenerateRecord.plan_of(job)
    assert plan.chained_job_id is not None
    return JobSpec(
        dataset_url=f"{storage.url.rstrip('/')}/{plan.output_key}",
        model_path=job.spec.model_path,
        job_id=plan.chained_job_id,
        max_length=job.spec.max_length,
        length_policy=job.spec.length_policy,
        draft_vocab_size=job.spec.draft_vocab_size,
        shard_token_budget=job.spec.shard_token_budget,
        shard_seconds=job.spec.shard_seconds,
        aux_layer_ids=job.aux_layer_ids,
        storage_dtype=job.spec.storage_dtype,
    )


def finalize_if_complete(
    job: JobRecord,
    *,
    storage: Storage,
    redis_client: redis.Redis,
    chain: ChainSubmit | None,
    settings: Settings | None = None,
) -> bool:
    """Once every shard is committed: assemble the dataset (create-only), write the failed list and the summary,
    copy the dataset to output_url, submit the chained extraction job. Idempotent, so whichever worker commits
    the last shard (or two at once, or a retry) can run it. True when the job is finalized."""
    plan = RegenerateRecord.plan_of(job)
    if progress.is_finalized(redis_client, job.job_id):
        return True
    if len(storage.list(layout.manifests_prefix(job.job_id))) < job.shards_total:
        return False
    manifests = load_manifests(storage, job.job_id)
    output_key = plan.output_key
    if not storage.exists(output_key):
        data = b"".join(storage.get(m.output_key) for m in manifests)
        storage.put_if_absent(output_key, data)
    failed = failed_conversations(storage, job.job_id)
    storage.put_if_absent(
        layout.failed_conversations(job.job_id), "".join(f.model_dump_json() + "\n" for f in failed).encode()
    )
    summary = summarize(job, manifests)
    error: str | None = None
    if plan.output_url is not None:
        try:
            locations.write_whole(plan.output_url, storage.get(output_key), settings)
        except (OSError, ConfigurationError) as exc:
            error = f"writing the dataset to {plan.output_url}: {exc}"
    chained_job_id = plan.chained_job_id
    if chained_job_id is not None and chain is None:
        error = error or f"chained job {chained_job_id}: this worker cannot submit it (no producer API)"
        chained_job_id = None
    elif chain is not None and chained_job_id is not None and not storage.exists(layout.job_json(chained_job_id)):
        try:
            chain(chained_spec(job, storage))
            logger.info("job=%s submitted chained extraction job=%s", job.job_id, chained_job_id)
        except SubmitError as exc:
            if not storage.exists(layout.job_json(chained_job_id)):  # else: a concurrent finalizer submitted it
                error = f"chained extraction job {chained_job_id}: {exc}"
                chained_job_id = None
    summary |= {"chained_job_id": chained_job_id, "error": error, "finalized_at": utc_now()}
    storage.put(layout.regeneration_summary(job.job_id), json.dumps(summary, indent=1).encode())
    progress.mark_finalized(redis_client, job.job_id, chained_job_id=chained_job_id, error=error)
    logger.info(
        "finalized regenerate job=%s conversations=%d failed=%d generated_tokens=%d%s",
        job.job_id,
        summary["conversations_written"],
        summary["conversations_failed"],
        summary["generated_tokens"],
        f" error: {error}" if error else "",
    )
    return True


def submit_through_api(spec: JobSpec, settings: Settings, *, timeout_s: float = 600.0) -> str:
    """Ask the producer API to submit a job (the chained extraction): it owns the model folder and the planning."""
    headers = access.auth_headers(settings)
    url = f"{settings.api_url.rstrip('/')}/v1/jobs"
    try:
        response = httpx.post(url, json=spec.model_dump(mode="json"), headers=headers, timeout=timeout_s)
    except httpx.TransportError as exc:
        raise ProducerUnavailable(f"{url}: {type(exc).__name__}: {exc}") from exc
    if response.status_code >= 500:
        raise ProducerUnavailable(f"{url}: {response.status_code} {response.text[:500]}")
    if response.status_code != 201:
        try:
            detail = response.json().get("detail", response.text)
        except ValueError:
            detail = response.text
        raise SubmitError(f"{response.status_code} {detail}")
    return response.json()["job"]["job_id"]


# ----------------------------------------------------------------------------------------------------------
# The kind


@dataclass
class RegenerateState:
    """Per worker process: the decoding client (more requests in flight than capture, so that the server batches
    them), the job tokenizers, and how the chained extraction job is submitted."""

    decoding: "InferenceClient"
    tokenizers: TokenizerCache = field(default_factory=TokenizerCache)
    chain: ChainSubmit | None = None
    settings: Settings | None = None


class Regenerate(JobKind[RegenerationShardInput, ConversationInput, ConversationResult, RegenerationManifest]):
    name = "regenerate"
    options = RegenerateOptions
    record = RegenerateRecord
    finalizes = True  # assembles the regenerated dataset (and submits the chained job) after its last shard
    input_type = RegenerationShardInput
    manifest_type = RegenerationManifest
    counters = REGENERATION_COUNTERS
    command = KindCommand(
        help="submit a regenerate job: the target rewrites every assistant turn (docs/regeneration.md)",
        description="The extraction options (--max-length ... --shard-token-budget) apply to the chained extraction "
        "job (--then-extract).",
        common_options=EXTRACTION_OPTIONS,
        flags={"output_url": ("--out",)},
        local_paths=("output_url",),
        watch_help="live progress until it (and the chained job) finishes",
    )

    def check_spec(self, spec: JobSpec, settings: Settings) -> None:
        output_url = RegenerateOptions.of(spec).output_url
        access.confine_output_url(output_url, settings)
        if output_url is not None and locations.exists(output_url, settings):
            raise SubmitError(f"output {output_url} already exists; the regenerated dataset is never overwritten")

    def accept(self, record: Conversation, spec: JobSpec, target: Target) -> Conversation:
        """The extraction's rules and messages (tokenize() included, so a conversation extraction would refuse is
        refused here), plus one of its own: preformatted text has no turns to regenerate."""
        if record.text is not None:
            raise InvalidRecord(
                record.sample_id, record.line, "text", "preformatted text has no turns to regenerate (use messages)"
            )
        target.tokenizer.tokenize(record, max_length=spec.max_length, length_policy=spec.length_policy)
        return record

    def plan(
        self, job_id: str, spec: JobSpec, target: Target, accepted: list[Conversation]
    ) -> JobPlan[RegenerationShardInput]:
        conversations = [
            ConversationInput(
                sample_index=index,
                sample_id=record.sample_id,
                line=record.line,
                messages=[ChatMessage(role=m.role, content=m.content) for m in record.messages],
            )
            for index, record in enumerate(accepted)
        ]
        options = RegenerateOptions.of(spec)
        turns_total = sum(m.role == "assistant" for c in conversations for m in c.messages)
        max_generated = turns_total * options.max_new_tokens
        shards = [
            RegenerationShardInput(
                job_id=job_id, shard_index=shard_index, conversations=[conversations[i] for i in members]
            )
            for shard_index, members in enumerate(
                plan_conversation_shards(len(conversations), options.conversations_per_shard)
            )
        ]
        return JobPlan(
            shards=shards,
            samples_total=len(conversations),
            tokens_total=max_generated,
            bytes_per_token=OUTPUT_BYTES_PER_TOKEN,
            projected_bytes=max_generated * OUTPUT_BYTES_PER_TOKEN,
            record={
                "samples_truncated": 0,
                "loss_tokens_total": 0,
                "draft_vocab_size": spec.draft_vocab_size,
                "vocab_coverage": 0.0,
                "regeneration": RegenerationPlan(
                    assistant_turns_total=turns_total,
                    max_generated_tokens=max_generated,
                    sampling_params=sampling_params(spec),
                    output_key=layout.regenerated_dataset(job_id),
                    output_url=options.output_url,
                    chained_job_id=layout.chained_job_id(job_id) if options.then_extract else None,
                    tokenizer_prefix=layout.tokenizer_prefix(job_id),
                ),
            },
            files=tokenizer_files(job_id, target.tokenizer),
        )

    def open(self, settings: Settings) -> RegenerateState:
        from shared.capture.client import InferenceClient

        decoding = InferenceClient(
            settings.inference_url,
            timeout_s=settings.inference_timeout_s,
            health_timeout_s=settings.inference_health_timeout_s,
            max_concurrency=settings.regenerate_concurrency,
        )
        # The producer plans the chained extraction job: it has the model folder, and the plan is its job.
        return RegenerateState(decoding, chain=lambda spec: submit_through_api(spec, settings), settings=settings)

    def prepare(self, ctx: ShardContext, state: RegenerateState, job: JobRecord) -> "ModelInfo":
        # A GPU server answers 503 for minutes while it loads; that is a wait, not a failure.
        state.decoding.wait_ready(ctx.settings.inference_ready_timeout_s)
        info = state.decoding.model_info()
        check_served_model(job, info, state.decoding.base_url, capture=False)
        return info

    def items(self, shard: RegenerationShardInput) -> list[ConversationInput]:
        return shard.conversations

    def item_key(self, job_id: str, item: ConversationInput) -> str:
        return layout.conversation(job_id, item.sample_index)

    def reuse(self, item: ConversationInput, key: str, data: bytes) -> ConversationResult:
        return ConversationResult.model_validate_json(data)

    def process(
        self,
        ctx: ShardContext,
        state: RegenerateState,
        prepared: "ModelInfo",
        job: JobRecord,
        shard: RegenerationShardInput,
        pending: list[ConversationInput],
        done: dict[int, ConversationResult],
    ) -> RegenerationManifest:
        started = time.monotonic()
        storage, info = ctx.storage, prepared
        renderer = state.tokenizers.get(storage, job)
        results = dict(done)

        def regenerate_and_write(conv: ConversationInput) -> ConversationResult:
            result = regenerate_conversation(
                conv,
                job=job,
                renderer=renderer,
                inference=state.decoding,
                max_context_length=info.max_context_length,
                is_cancelled=lambda: progress.is_cancelled(ctx.redis, job.job_id),
            )
            key = layout.conversation(job.job_id, conv.sample_index)
            if not storage.put_if_absent(key, result.model_dump_json().encode()):
                # A concurrent duplicate delivery wrote it first; its version is the one the manifest must describe.
                result = ConversationResult.model_validate_json(storage.get(key))
            return result

        # Longest first (most assistant turns, which run one after another): the shard's tail, where fewer
        # conversations are left than the server could batch, is then short.
        pending = sorted(pending, key=lambda conv: -sum(m.role == "assistant" for m in conv.messages))
        workers = max(1, min(ctx.settings.regenerate_concurrency, len(pending)))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="decode") as pool:
            futures = [pool.submit(regenerate_and_write, conv) for conv in pending]
            try:
                for future in as_completed(futures):
                    result = future.result()
                    results[result.sample_index] = result
            except BaseException:  # Cancelled among them: what is written stays for a resume
                for future in futures:
                    future.cancel()
                raise
        decode_s = time.monotonic() - started

        ordered = [results[c.sample_index] for c in shard.conversations]
        output_key = layout.regenerated_shard(job.job_id, shard.shard_index)
        data = "".join(output_line(r) for r in ordered if not r.failed).encode()
        if not storage.put_if_absent(output_key, data):
            data = storage.get(output_key)
        ok = [r for r in ordered if not r.failed]
        options = RegenerateOptions.of(job.spec)
        logger.info(
            "job=%s shard=%d decoded %d conversations (%d failed), %d generated tokens at %.0f tokens/s",
            job.job_id,
            shard.shard_index,
            len(ordered),
            len(ordered) - len(ok),
            sum(r.generated_tokens for r in ok),
            sum(r.generated_tokens for r in ok) / max(decode_s, 1e-9),
        )
        return RegenerationManifest(
            job_id=job.job_id,
            shard_index=shard.shard_index,
            model=info.model_path,
            server={"backend": info.backend, "version": info.version, "sglang_version": info.sglang_version},
            sampling_params=sampling_params(job.spec) | ({"seed": options.seed} if options.seed is not None else {}),
            reasoning=options.reasoning,
            output_key=output_key,
            sha256=hashlib.sha256(data).hexdigest(),
            conversations=[_entry(r, layout.conversation(job.job_id, r.sample_index)) for r in ordered],
            num_samples=len(ok),
            num_tokens=sum(r.generated_tokens for r in ok),
            bytes=len(data),
            counters=shard_counters(ordered),
            timings_s={"decode": round(decode_s, 4)},
        )

    def after_commit(self, ctx: ShardContext, state: RegenerateState, job: JobRecord) -> None:
        finalize_if_complete(job, storage=ctx.storage, redis_client=ctx.redis, chain=state.chain, settings=ctx.settings)

    def after_failure(self, ctx: ShardContext, job_id: str, shard_index: int, reason: str) -> bool:
        # Committed, so assembling or chaining failed for good: the job ends completed_with_errors, with the reason.
        progress.record_finalize_error(ctx.redis, job_id, reason)
        logger.error("job=%s: assembling the regenerated dataset failed: %s", job_id, reason)
        return True

    def progress_fields(self, job: JobRecord) -> dict[FieldT, EncodableT]:
        plan = RegenerateRecord.plan_of(job)
        return {"max_generated_tokens": plan.max_generated_tokens, "output_key": plan.output_key}

    def progress(
        self, number: Mapping[str, int], fields: Mapping[str, str], finished: bool
    ) -> tuple[int, dict[str, Any]]:
        """Generated tokens, projected from the conversations done so far; the conversations' counts (this kind's
        counters) and the chain."""
        section = RegenerationProgress.model_validate(
            dict(number)
            | {
                "max_generated_tokens": number.get("max_generated_tokens", number["tokens_total"]),
                "finalized": bool(number.get(progress.FINALIZED)),
                "output_key": fields.get("output_key"),
                "chained_job_id": fields.get("chained_job_id"),
                "error": fields.get(progress.FINALIZE_ERROR),
            }
        )
        return projected_generated_tokens(number, finished=finished), {"regeneration": section}

    def failed(self, storage: Storage, job_id: str) -> list[FailedConversation]:
        return failed_conversations(storage, job_id)

    def after_resume(self, storage: Storage, client: redis.Redis, job: JobRecord, pending: list[int]) -> list[int]:
        progress.retry_failed_finalize(client, job.job_id)  # assembling or chaining failed: it runs again
        if not pending and not progress.is_finalized(client, job.job_id):
            return [job.shards_total - 1]  # committed: the task goes straight to assembling
        return []

    def training_job(self, storage: Storage, job: JobRecord, *, wait_s: float = 0.0) -> str:
        """A regenerated dataset is not training data: its chained extraction job is (waiting up to wait_s for the
        regeneration to submit it)."""
        chained = RegenerateRecord.plan_of(job).chained_job_id
        if chained is None:
            raise ConfigurationError(f"job {job.job_id} regenerates without then_extract: there is nothing to train on")
        deadline = time.monotonic() + wait_s
        while not storage.exists(layout.job_json(chained)):
            if storage.exists(layout.regeneration_summary(job.job_id)):  # finalized without submitting it
                summary = json.loads(storage.get(layout.regeneration_summary(job.job_id)))
                if not storage.exists(layout.job_json(chained)):
                    raise ConfigurationError(f"job {job.job_id} did not submit {chained}: {summary.get('error')}")
            if time.monotonic() >= deadline:
                raise ConfigurationError(
                    f"job {job.job_id} has not submitted its extraction job {chained} yet "
                    "(it does when regeneration ends)"
                )
            time.sleep(CHAIN_POLL_S)
        return chained

    def follow(self, record: Mapping[str, Any], session: CommandSession) -> None:
        """The plan (conversations, turns, where the output goes, the chained job) and, with --watch, the progress of
        the job and then of its chained extraction job."""
        plan = record["regeneration"]
        session.say(
            f"submitted [bold]{record['job_id']}[/]: {record['samples_total']} conversations "
            f"({record['samples_rejected']} rejected), {plan['assistant_turns_total']} assistant turns to regenerate, "
            f"{record['shards_total']} shards; output {plan['output_key']}"
            + (f" and {plan['output_url']}" if plan["output_url"] else "")
        )
        if plan["chained_job_id"]:
            session.say(f"then extraction job [bold]{plan['chained_job_id']}[/] on the regenerated conversations")
        if record["spec"]["then_train"]:
            session.say(f"train on it with: eagle3 train --job {record['job_id']} --follow")
        if not session.watching:
            return
        p = session.watch(record["job_id"])
        session.show_progress(p)
        chained = p.regeneration.chained_job_id if p.regeneration else None
        if chained is not None:
            session.show_progress(session.watch(chained))
