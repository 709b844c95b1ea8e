"""What a job kind supplies. Everything else about a job is written once, for every kind:

- submit (shared/lifecycle/jobs.py): services up, model folder, job id, tokenizer, layer ids, the dataset with its
  rejected lines, budget, job.json, shard inputs, progress counters, one task per shard; resume and cancel;
- one shard (shared/lifecycle/shards.py): already committed -> cancelled -> load the job -> check the served model once
  per job -> load the shard input -> reuse what an earlier attempt wrote -> the kind's work -> commit the manifest
  create-only and count it once -> dead letter when it fails for good.

A kind says which options a job of it takes beside the common ones (`options`: the fields of JobSpec that only it
reads, validated at submit and whenever job.json is read), what it records in job.json beside the common fields
(`record`, checked the same way), what a shard input is (`plan`, `input_type`), what
processing a shard means (`process`), what its committed output is (`manifest_type`), which counters of its own that
output adds to the job's progress (`counters`), whether the job needs one more step after its last shard before it is
complete (`finalizes`), which job a drafter trains on (`training_job`), and its command on the command line
(`command`: `eagle3 <name>` and its arguments; `follow`: what it shows once the job is submitted). Adding a kind is
one new module in shared/lifecycle/kinds/ and one line in its `__init__.py`; the registry there refuses a kind that
leaves one of these declarations out. A kind module loads nothing heavy at import (torch, the capture client): the
command line reads the registry to build its commands, and imports what a kind's work needs where it needs it.
"""

import json
import logging
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Self, TypeVar

import redis
from pydantic import BaseModel, ConfigDict
from redis.typing import EncodableT, FieldT

from shared.data.datasets import Conversation
from shared.data.model_assets import language_model_config
from shared.data.tokenization import ChatTokenizer
from shared.errors import ModelMismatch
from shared.lifecycle.command import CommandSession, KindCommand
from shared.lifecycle.queue import task_name
from shared.lifecycle.schemas import DeadLetter, FailedConversation, JobRecord, JobSpec, ModelRecord
from shared.settings import Settings
from shared.storage import layout
from shared.storage.objects import ObjectNotFound, Storage

if TYPE_CHECKING:  # the capture protocol loads torch, which the registry of kinds must not (the command line reads it)
    from shared.capture.protocol import ModelInfo

logger = logging.getLogger(__name__)

InputT = TypeVar("InputT", bound=BaseModel)  # one shard's planned input (inputs/shard_{k}.json)
ItemT = TypeVar("ItemT", bound=BaseModel)  # one element of it: a sample, a conversation
DoneT = TypeVar("DoneT")  # what an item leaves in storage once done, as the manifest needs it
ManifestT = TypeVar("ManifestT", bound=BaseModel)  # manifests/shard_{k}.json
KeptT = TypeVar("KeptT")  # what a worker process keeps for a job: its checked server, its tokenizer

# How many jobs a worker process keeps what it prepared for (RecentJobs): the jobs whose shards reach it in turn. With
# more jobs than this running at once, a shard prepares its job again (a request to the server, a tokenizer loaded
# again), which costs a second or two against a shard's minutes, not a failure.
RECENT_JOBS = 2


class KindOptions(BaseModel):
    """The options of a job kind beside JobSpec's common fields: a kind subclasses this with its own fields. Given in
    the same flat submit body and recorded in job.json's spec; a key no field of the job's kind names is refused."""

    model_config = ConfigDict(extra="forbid")

    @classmethod
    def of(cls, spec: JobSpec) -> Self:
        """This kind's options of a spec (JobSpec checked them when it was built)."""
        return cls.model_validate(spec.model_extra or {})


class KindRecord(BaseModel):
    """What a job kind records in job.json beside JobRecord's common fields, at submit: a kind subclasses this with its
    own fields (its plan's `record` gives them). A key no field of the job's kind names is refused when job.json is
    read, so that nothing a kind wrote is dropped without a word."""

    model_config = ConfigDict(extra="forbid")

    @classmethod
    def of(cls, job: JobRecord) -> Self:
        """This kind's fields of a job's record (JobRecord checked them when it was read)."""
        return cls.model_validate(job.model_extra or {})


class RecentJobs(Generic[KeptT]):
    """What a worker process keeps per job (what its kind's prepare() returned, a job's tokenizer), for the last
    `size` jobs it ran shards of. A worker runs any number of jobs in its life: kept for every one of them, these
    would grow it with every job for as long as it runs (a regenerate job's tokenizer is about 9 MB for SmolLM2's).
    A job met again after it left is prepared again: a request to the server or a download, not a different result.
    Not thread-safe: a caller that shares it between threads holds a lock around it."""

    def __init__(self, size: int = RECENT_JOBS) -> None:
        self.size = size
        self._kept: OrderedDict[str, KeptT] = OrderedDict()  # least recently used first

    def get(self, job_id: str, make: Callable[[], KeptT]) -> KeptT:
        """The job's kept value, made (and kept, the least recently used job leaving) if there is none."""
        if job_id in self._kept:
            self._kept.move_to_end(job_id)
            return self._kept[job_id]
        value = make()
        self._kept[job_id] = value
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)
        return value

    def forget(self, job_id: str) -> None:
        self._kept.pop(job_id, None)

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._kept

    def __len__(self) -> int:
        return len(self._kept)


@dataclass
class ShardContext:
    """What a worker process lends every shard it runs: clients, its name, settings, per-kind state."""

    storage: Storage
    redis: redis.Redis
    settings: Settings
    worker: str
    states: dict[str, Any] = field(default_factory=dict)  # kind name -> what its open() returned
    prepared: RecentJobs[Any] = field(default_factory=RecentJobs)  # job id -> what its kind's prepare() returned

    def state(self, kind: "JobKind") -> Any:
        if kind.name not in self.states:
            self.states[kind.name] = kind.open(self.settings)
        return self.states[kind.name]


@dataclass(frozen=True)
class TargetModel:
    """The target model as its folder gives it: the config and the layers to capture (the preflight checks need no
    more)."""

    path: Path
    config: dict[str, Any]
    aux_layer_ids: list[int]

    @property
    def num_hidden_layers(self) -> int:
        return int(language_model_config(self.config)["num_hidden_layers"])

    @property
    def hidden_size(self) -> int:
        return int(language_model_config(self.config)["hidden_size"])

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary (its embedding and logit rows), as a server reports it: the tokenizer's own count
        can be smaller (padded embeddings) or, with a tokenizer shared across model sizes, unrelated."""
        return int(language_model_config(self.config)["vocab_size"])

    @classmethod
    def read(cls, path: Path, aux_layer_ids: list[int] | None) -> "TargetModel":
        from shared.capture.protocol import default_aux_layer_ids  # loads torch: only where a model is read

        config = json.loads((path / "config.json").read_text())
        ids = aux_layer_ids or default_aux_layer_ids(int(language_model_config(config)["num_hidden_layers"]))
        return TargetModel(path=path, config=config, aux_layer_ids=ids)


@dataclass(frozen=True)
class Target(TargetModel):
    """The target model as the producer reads it at submit: `TargetModel` and its tokenizer."""

    tokenizer: ChatTokenizer

    @classmethod
    def load(cls, path: Path, tokenizer: ChatTokenizer, aux_layer_ids: list[int] | None) -> "Target":
        model = TargetModel.read(path, aux_layer_ids)
        return cls(path=model.path, config=model.config, aux_layer_ids=model.aux_layer_ids, tokenizer=tokenizer)

    def record(self) -> ModelRecord:
        return ModelRecord(
            path=str(self.path),
            architecture=(self.config.get("architectures") or ["unknown"])[0],
            num_hidden_layers=self.num_hidden_layers,
            hidden_size=self.hidden_size,
            vocab_size=self.vocab_size,
            template_hash=self.tokenizer.template_hash,
        )


@dataclass
class JobPlan(Generic[InputT]):
    """A kind's plan of a job: its shard inputs, the numbers job.json records, and files written beside them."""

    shards: list[InputT]
    samples_total: int
    tokens_total: int
    bytes_per_token: int
    projected_bytes: int
    record: dict[str, Any] = field(default_factory=dict)  # JobRecord's fields as this kind fills them, its own too
    files: dict[str, bytes] = field(default_factory=dict)  # storage key -> bytes, written before job.json


class JobKind(ABC, Generic[InputT, ItemT, DoneT, ManifestT]):
    name: ClassVar[str]  # JobSpec.kind
    # Declared by every kind (the registry checks): its options beside JobSpec's common fields (KindOptions itself for
    # none), its own fields of job.json beside JobRecord's (KindRecord itself for none), and whether a job of it runs a
    # last step after its final shard (progress keeps it `running` until the kind records `finalized`, or the error
    # that stopped it).
    options: ClassVar[type[KindOptions]]
    record: ClassVar[type[KindRecord]]
    finalizes: ClassVar[bool]
    # Its command, `eagle3 <name>` (shared/lifecycle/command.py): help, arguments, which common fields it offers.
    command: ClassVar[KindCommand]
    # Each kind's class sets these two, like the class variables here; they are not annotated ClassVar only because
    # a ClassVar cannot hold a type variable, and this way a shard input read back is an InputT, a manifest a ManifestT.
    input_type: type[InputT]
    manifest_type: type[ManifestT]
    # This kind's own counters in its jobs' progress, beside progress.COUNTERS: name -> what it counts (its metric's
    # help). A committed manifest adds to them through its `counters`; progress sets them to zero when it registers a
    # job and recounts them from the manifests, so every counter a manifest carries is declared here.
    counters: ClassVar[Mapping[str, str]] = {}
    # Whether a job of this kind plans from the records of `dataset_url` (accept); a kind that does not picks its
    # items itself (select), from what is already in storage.
    reads_dataset: ClassVar[bool] = True

    DECLARATIONS: ClassVar[tuple[str, ...]] = (
        "name",
        "input_type",
        "manifest_type",
        "options",
        "record",
        "finalizes",
        "command",
    )

    @property
    def task_name(self) -> str:
        return task_name(self.name)

    @property
    def command_name(self) -> str:
        """Its subcommand: `eagle3 <command_name>`."""
        return self.command.name or self.name

    # ---- submit (the producer) ------------------------------------------------------------------------------

    def complete_spec(self, spec: JobSpec, storage: Storage) -> JobSpec:
        """The spec with what this kind takes from storage filled in (before the model is resolved); SubmitError
        when it names something that is not there."""
        return spec

    def select(self, spec: JobSpec, storage: Storage) -> list[Any]:
        """The items a kind that reads no dataset plans (reads_dataset False), as `accept` would have returned them."""
        raise NotImplementedError(f"job kind {self.name} reads a dataset")

    def check_spec(self, spec: JobSpec, settings: Settings) -> None:
        """Refuse a spec for reasons of this kind, before the dataset is read (SubmitError)."""

    def accept(self, record: Conversation, spec: JobSpec, target: Target) -> Any:
        """One dataset record as this kind plans it (reads_dataset); InvalidRecord rejects it with its field and
        reason."""
        raise NotImplementedError(f"job kind {self.name} reads no dataset")

    @abstractmethod
    def plan(self, job_id: str, spec: JobSpec, target: Target, accepted: list[Any]) -> JobPlan[InputT]:
        """The shards of a job and what its job.json records."""

    # ---- progress -------------------------------------------------------------------------------------------

    def progress_fields(self, job: JobRecord) -> dict[FieldT, EncodableT]:
        """What this kind's part of the progress (`progress`) reads from the job's Redis hash beside the counters,
        written there when the job is registered."""
        return {}

    def progress(
        self, number: Mapping[str, int], fields: Mapping[str, str], finished: bool
    ) -> tuple[int, dict[str, Any]]:
        """This kind's part of a job's progress, from the job's Redis hash (its numbers, and every field as text):
        the job's tokens total (the plan's, unless the kind projects another) and its own fields of Progress."""
        return number["tokens_total"], {}

    # ---- one shard (a worker) ---------------------------------------------------------------------------------

    @abstractmethod
    def open(self, settings: Settings) -> Any:
        """Per worker process: this kind's clients and caches (built lazily, after the pool forks)."""

    @abstractmethod
    def prepare(self, ctx: ShardContext, state: Any, job: JobRecord) -> Any:
        """Once per job and process (kept for the process's recent jobs, RecentJobs): wait for the server and check
        that it serves the job's model."""

    @abstractmethod
    def items(self, shard: InputT) -> list[ItemT]: ...

    @abstractmethod
    def item_key(self, job_id: str, item: ItemT) -> str:
        """Where an item's result is written create-only, so that a retried shard does not do it again."""

    @abstractmethod
    def reuse(self, item: ItemT, key: str, data: bytes) -> DoneT:
        """What an earlier attempt left at item_key, as process() would have returned it."""

    @abstractmethod
    def process(
        self,
        ctx: ShardContext,
        state: Any,
        prepared: Any,
        job: JobRecord,
        shard: InputT,
        pending: list[ItemT],
        done: dict[int, DoneT],
    ) -> ManifestT:
        """Do the pending items (writing each result create-only), then describe the whole shard; the frame commits
        the manifest. May raise Cancelled."""

    def after_commit(self, ctx: ShardContext, state: Any, job: JobRecord) -> None:
        """After a shard of this job is committed (by this delivery or an earlier one)."""

    def after_failure(self, ctx: ShardContext, job_id: str, shard_index: int, reason: str) -> bool:
        """A task failed for good after its shard was committed (a step of after_commit); True if handled."""
        return False

    def after_resume(self, storage: Storage, client: redis.Redis, job: JobRecord, pending: list[int]) -> list[int]:
        """Shards to enqueue again besides the uncommitted ones (e.g. to redo after_commit)."""
        return []

    def failed(self, storage: Storage, job_id: str) -> list[FailedConversation]:
        """Every sample of the job that will not be in its output, with the reason."""
        return sorted(dead_lettered_samples(self, storage, job_id), key=lambda f: f.sample_index)

    def shard_size(self, shard: InputT) -> tuple[int, int]:
        """(samples, tokens) a dead-lettered shard takes from the job's progress."""
        items = self.items(shard)
        return len(items), 0

    def dead_shard_size(self, storage: Storage, job_id: str, shard_index: int) -> tuple[int, int]:
        """shard_size of a dead-lettered shard's planned input. A shard whose input is missing still counts as a dead
        shard, with nothing in it: progress cannot count what was never planned, and its dead letter says why."""
        try:
            return self.shard_size(read_shard_input(self, storage, job_id, shard_index))
        except ObjectNotFound:
            logger.error("job=%s shard=%d has no input in %s", job_id, shard_index, storage.url)
            return 0, 0

    # ---- the command line (it has the job's record from the API, not the kind's work) ----------------------------

    def follow(self, record: Mapping[str, Any], session: CommandSession) -> None:
        """What the kind's command shows once it submitted a job (`record`: the job as the API answered): by default
        its size and, with --watch, its progress until it finishes."""
        session.say(
            f"submitted [bold]{record['job_id']}[/]: {record['samples_total']} samples "
            f"({record['samples_rejected']} rejected), {record['tokens_total']} tokens, {record['shards_total']} shards"
        )
        if session.watching:
            session.show_progress(session.watch(record["job_id"]))

    # ---- training (the trainer) -------------------------------------------------------------------------------

    def training_job(self, storage: Storage, job: JobRecord, *, wait_s: float = 0.0) -> str:
        """The id of the job whose output a drafter trains on when asked to train on `job`: the job itself. A kind
        whose output is not training data names the job that turns it into some, waiting up to wait_s for it."""
        return job.job_id


def check_served_model(job: JobRecord, info: "ModelInfo", base_url: str, *, capture: bool) -> None:
    """The server must serve the model the job was planned for; otherwise every tensor or token would be wrong."""
    expected = {
        "hidden_size": job.hidden_size,
        "num_hidden_layers": job.model.num_hidden_layers,
        "vocab_size": job.model.vocab_size,
    }
    served = {name: getattr(info, name) for name in expected}
    if served != expected:
        raise ModelMismatch(
            f"job {job.job_id} was planned for {job.model.path} {expected}, "
            f"but {base_url} serves {info.model_path} {served}"
        )
    if (
        capture
        and info.capture_aux_layer_ids is not None
        and sorted(info.capture_aux_layer_ids) != sorted(job.aux_layer_ids)
    ):
        raise ModelMismatch(
            f"job {job.job_id} captures layers {job.aux_layer_ids}, but {base_url} was launched to capture "
            f"{info.capture_aux_layer_ids} (EAGLE3_AUX_LAYER_IDS of the SGLang container)"
        )


def read_shard_input(kind: JobKind[InputT, Any, Any, Any], storage: Storage, job_id: str, shard_index: int) -> InputT:
    """The planned input of one shard, as its kind's model."""
    return kind.input_type.model_validate_json(storage.get(layout.shard_input(job_id, shard_index)))


def dead_lettered_samples(kind: JobKind, storage: Storage, job_id: str) -> list[FailedConversation]:
    """Every sample of every shard that is dead-lettered and not committed since, with the shard's reason."""
    committed = {layout.shard_index_from_manifest_key(k) for k in storage.list(layout.manifests_prefix(job_id))}
    failed = []
    for key in storage.list(layout.dead_letter_prefix(job_id)):
        letter = DeadLetter.model_validate_json(storage.get(key))
        if letter.shard_index in committed:
            continue
        shard = read_shard_input(kind, storage, job_id, letter.shard_index)
        failed += [
            FailedConversation(
                sample_index=item.sample_index,
                sample_id=item.sample_id,
                line=item.line,
                reason=f"shard dead-lettered: {letter.error_type}: {letter.reason}",
                shard_index=letter.shard_index,
            )
            for item in kind.items(shard)
        ]
    return failed
