"""Checkpoints: one typed record, one save path, one load path.

A checkpoint holds only tensors and plain Python values, so it loads with torch.load(weights_only=True):
checkpoints live in shared storage and must never run code when read. `Checkpoint.to_payload` and
`Checkpoint.from_payload` are the only places that know the dict's keys; everything else reads typed fields.

Storage keys of a run, under JOB/trainer/RUN/checkpoints/:
    step_00000500.pt   one per saved step; the newest `keep_checkpoints` are kept
    latest.json        {"key": ..., "step": ..., "saved_at": ...}, written after the .pt
    curves.html        the training curves (curves.py), rewritten with each checkpoint

A resumed run is built fresh from its config, then restored from the record (train.py, `Trainer.restore`).
"""

import hashlib
import io
import json
import logging
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from torch import Tensor, nn

from services.trainer.config import TrainConfig
from services.trainer.data import DataPosition, DataStats
from services.trainer.drafter import DrafterConfig, Eagle3Drafter, TargetHead, build_drafter
from shared.data.vocab import VocabMapping
from shared.errors import ConfigurationError
from shared.storage import layout
from shared.storage.objects import ObjectNotFound, Storage

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1


# Settings that checkpoints of earlier versions hold and this one no longer has: `recompute_logits` (the fused loss
# has taken lm_head's gradients in forward since, which keeps less for backward than recomputing the logits did).
RETIRED_SETTINGS = frozenset({"recompute_logits"})


def _current(settings: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in settings.items() if name not in RETIRED_SETTINGS}


@dataclass
class RankState:
    """What differs between DDP ranks: the RNG streams and the counts of samples read and skipped."""

    rng: dict[str, Any]
    data_stats: DataStats

    def to_payload(self) -> dict[str, Any]:
        return {"rng": self.rng, "data_stats": self.data_stats.as_dict()}

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> "RankState":
        return cls(rng=payload["rng"], data_stats=DataStats.from_dict(payload["data_stats"]))


@dataclass
class Checkpoint:
    """Everything a run needs to continue exactly, and everything evaluation and export need to rebuild the
    drafter around its target."""

    job_id: str
    run_name: str
    step: int
    saved_at: str
    model_path: str  # the target trained against
    drafter_config: DrafterConfig
    train_config: TrainConfig
    drafter: dict[str, Tensor]  # trainable weights and the d2t/t2d buffers; never the target's frozen embedding
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    schedule_steps: int
    data_position: DataPosition
    ranks: list[RankState]  # one per process of the run that saved it
    train_tokens: int
    train_seconds: float
    history: list[dict[str, Any]]  # one point per log window (curves.py)
    provenance: dict[str, Any] | None = None  # the job's (shared/provenance.py); None for jobs recorded before it
    source: str = field(default="", compare=False)  # the key or path it was read from; not saved

    def to_payload(self) -> dict[str, Any]:
        return {
            "format": CHECKPOINT_FORMAT,
            "job_id": self.job_id,
            "run_name": self.run_name,
            "step": self.step,
            "saved_at": self.saved_at,
            "model_path": self.model_path,
            "drafter": self.drafter,
            "drafter_config": asdict(self.drafter_config),
            "train_config": self.train_config.model_dump(mode="json"),
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "schedule_steps": self.schedule_steps,
            "data_position": self.data_position.model_dump(),
            "ranks": [rank.to_payload() for rank in self.ranks],
            "train_tokens": self.train_tokens,
            "train_seconds": self.train_seconds,
            "history": self.history,
            "provenance": self.provenance,
        }

    @classmethod
    def from_payload(cls, payload: Any, *, source: str) -> "Checkpoint":
        if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
            raise ConfigurationError(f"checkpoint {source}: not a format-{CHECKPOINT_FORMAT} trainer checkpoint")
        try:
            return cls(
                job_id=payload["job_id"],
                run_name=payload["run_name"],
                step=int(payload["step"]),
                saved_at=payload["saved_at"],
                model_path=payload["model_path"],
                drafter_config=DrafterConfig(**_current(payload["drafter_config"])),
                train_config=TrainConfig.model_validate(_current(payload["train_config"])),
                drafter=payload["drafter"],
                optimizer=payload["optimizer"],
                scheduler=payload["scheduler"],
                schedule_steps=int(payload["schedule_steps"]),
                data_position=DataPosition.model_validate(payload["data_position"]),
                ranks=[RankState.from_payload(rank) for rank in payload["ranks"]],
                train_tokens=int(payload["train_tokens"]),
                train_seconds=float(payload["train_seconds"]),
                history=list(payload["history"]),
                provenance=payload.get("provenance"),  # absent from checkpoints saved before it was recorded
                source=source,
            )
        except KeyError as exc:
            raise ConfigurationError(f"checkpoint {source}: field {exc} is missing") from None
        except (TypeError, ValidationError) as exc:
            raise ConfigurationError(f"checkpoint {source}: {exc}") from None

    @property
    def vocab_mapping(self) -> VocabMapping:
        """The vocab mapping the drafter was trained with: its d2t/t2d buffers travel in the checkpoint."""
        d2t, t2d = self.drafter["d2t"], self.drafter["t2d"]
        return VocabMapping(d2t=d2t, t2d=t2d, coverage=None, draft_vocab_size=d2t.numel())


def save_checkpoint(storage: Storage, checkpoint: Checkpoint, *, keep: int) -> str:
    """Write the step's .pt, then point latest.json at it, then drop all but the newest `keep`."""
    job_id, run_name = checkpoint.job_id, checkpoint.run_name
    key = layout.trainer_checkpoint(job_id, run_name, checkpoint.step)
    buffer = io.BytesIO()
    torch.save(checkpoint.to_payload(), buffer)
    storage.put(key, buffer.getvalue())
    latest = {"key": key, "step": checkpoint.step, "saved_at": checkpoint.saved_at}
    storage.put(layout.trainer_latest(job_id, run_name), json.dumps(latest).encode())
    for old in storage.list(layout.trainer_checkpoints(job_id, run_name) + "step_")[:-keep]:
        storage.delete(old)
    logger.info("checkpoint step %d -> %s (%d bytes)", checkpoint.step, key, buffer.tell())
    return key


def load_checkpoint(ref: str, storage: Storage) -> Checkpoint:
    """A checkpoint from a local .pt path, a storage key, a `latest.json` key, or a run prefix `JOB/trainer/RUN`."""
    path = Path(ref)
    if path.suffix == ".pt" and path.is_file():
        data, source = path.read_bytes(), str(path)
    else:
        key = ref
        if not key.endswith(".pt"):
            latest = key if key.endswith("latest.json") else f"{key.rstrip('/')}/checkpoints/latest.json"
            try:
                key = json.loads(storage.get(latest))["key"]
            except ObjectNotFound as exc:
                raise ConfigurationError(f"checkpoint {ref!r}: no such file, key or run ({latest} missing)") from exc
        try:
            data, source = storage.get(key), key
        except ObjectNotFound as exc:
            raise ConfigurationError(f"checkpoint {ref!r}: {key} not found in {storage.url}") from exc
    # weights_only: a checkpoint in shared storage must never be able to run code when loaded.
    payload = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    return Checkpoint.from_payload(payload, source=source)


def find_resume_checkpoint(
    storage: Storage, config: TrainConfig, *, resume: bool, resume_from: str | None
) -> Checkpoint | None:
    """The checkpoint a run continues from: `resume_from`, or with `resume` the run's latest if it has one."""
    if resume_from is None and not resume:
        return None
    if resume_from is None and not storage.exists(layout.trainer_latest(config.job_id, config.run_name)):
        logger.info("run %s of job %s has no checkpoint yet: starting fresh", config.run_name, config.job_id)
        return None
    checkpoint = load_checkpoint(resume_from or layout.trainer_latest(config.job_id, config.run_name), storage)
    if checkpoint.job_id != config.job_id:
        raise ConfigurationError(
            f"checkpoint {checkpoint.source} belongs to job {checkpoint.job_id}, not {config.job_id}"
        )
    logger.info("resuming job %s from %s (step %d)", config.job_id, checkpoint.source, checkpoint.step)
    return checkpoint


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG streams (Python, torch CPU, CUDA when in use), as plain values."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ---------------------------------------------------------------------------------------------------------------------
# The drafter's weights in a checkpoint


def frozen_parameter_names(drafter: nn.Module) -> set[str]:
    return {name for name, p in drafter.named_parameters() if not p.requires_grad}


def trainable_state(drafter: nn.Module) -> dict[str, Tensor]:
    """The drafter's state without its frozen parameters (the target's embedding, reloaded from the target)."""
    frozen = frozen_parameter_names(drafter)
    return {name: t.detach().cpu() for name, t in drafter.state_dict().items() if name not in frozen}


def load_trainable_state(drafter: nn.Module, state: dict[str, Tensor], *, source: str) -> None:
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    not_frozen = set(missing) - frozen_parameter_names(drafter)
    if unexpected or not_frozen:
        raise ConfigurationError(
            f"{source}: drafter weights do not fit: missing {sorted(not_frozen)}, unexpected {sorted(unexpected)}"
        )


def parameters_sha256(drafter: nn.Module) -> str:
    """A fingerprint of the trainable weights, byte for byte (DDP ranks must agree exactly)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(trainable_state(drafter).items()):
        digest.update(name.encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def restore_drafter(drafter: Eagle3Drafter, checkpoint: Checkpoint, *, built_from: str) -> None:
    """Load a checkpoint's weights into a drafter built fresh for the same target; refuse if the shapes differ."""
    if drafter.config != checkpoint.drafter_config:
        raise ConfigurationError(
            f"checkpoint {checkpoint.source}: trained as drafter config {asdict(checkpoint.drafter_config)}, but "
            f"{built_from} gives {asdict(drafter.config)}"
        )
    load_trainable_state(drafter, checkpoint.drafter, source=checkpoint.source)


def drafter_from_checkpoint(
    checkpoint: Checkpoint, *, model_path: str | Path | None = None
) -> tuple[Eagle3Drafter, TargetHead]:
    """The trained drafter (and the frozen target head) of a checkpoint, rebuilt around the target model."""
    target = Path(model_path or checkpoint.model_path)
    drafter, target_head = build_drafter(
        target,
        checkpoint.vocab_mapping,
        aux_layer_ids=checkpoint.drafter_config.aux_layer_ids,
        init_from_target=False,
    )
    restore_drafter(drafter, checkpoint, built_from=f"the target at {target}")
    return drafter, target_head
