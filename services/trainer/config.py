"""Every knob of a training run, in one place: `TrainConfig` is saved in each checkpoint and generates the
`eagle3 train` flags, so adding a knob is a one-field edit (its `description` is the flag's help).

A flag is only passed on when given (argparse.SUPPRESS), so `model_fields_set` tells an explicit value from a
default; a resumed run needs that to know what the user meant to change (`resumed_config`).
"""

import argparse
import logging
import types
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared.errors import ConfigurationError

logger = logging.getLogger(__name__)


class TrainConfig(BaseModel):
    """Every knob of a training run; saved in each checkpoint."""

    model_config = ConfigDict(extra="forbid")

    job_id: str = Field(description="the extraction job whose committed shards are trained on")
    run_name: str = Field(
        default="default",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
        description="checkpoints go to JOB/trainer/RUN_NAME/",
    )
    model_path: str | None = Field(default=None, description="the target's Hugging Face folder (default: the job's)")
    aux_layer_ids: list[int] | None = Field(
        default=None, description="the target layers the drafter consumes (default: the job's)"
    )
    require_audit: bool = Field(
        default=False, description="refuse a job whose last audit failed or that was never audited (else: a warning)"
    )
    follow: bool = Field(default=False, description="keep taking shards as they are committed until the job ends")
    epochs: int = Field(default=1, ge=1, description="passes over the training shards")
    max_steps: int | None = Field(default=None, ge=1, description="stop after this many optimizer steps")
    max_seconds: float | None = Field(default=None, gt=0, description="time budget of this invocation")
    schedule_steps: int | None = Field(
        default=None, ge=1, description="length of the warmup + cosine schedule (default: max steps or an estimate)"
    )
    batch_tokens: int = Field(default=8192, ge=2, description="padded B x T of one micro-batch on one process")
    max_length: int = Field(default=2048, ge=3, description="samples are truncated to this many tokens")
    grad_accum: int = Field(default=1, ge=1, description="micro-batches per process per optimizer step")
    lr: float = Field(default=1e-4, gt=0, description="peak learning rate")
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1, description="the cosine ends at lr x this")
    warmup_ratio: float = Field(default=0.015, ge=0, lt=1, description="share of the schedule spent warming up")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay (not on norms)")
    betas: tuple[float, float] = Field(default=(0.9, 0.95), description="AdamW betas")
    max_grad_norm: float = Field(default=0.5, gt=0, description="gradients are clipped to this global norm")
    init_from_target: bool = Field(
        default=True, description="start lm_head, norm and fc from the target's (drafter.py), not at random"
    )
    ttt_length: int = Field(default=7, ge=1, description="unrolled draft steps of the training-time test")
    step_decay: float = Field(default=0.8, gt=0, description="loss weight of draft step i is step_decay**i")
    seed: int = Field(default=0, description="data order and initial weights")
    heldout_fraction: float = Field(default=0.05, ge=0, lt=1, description="share of shards held out from training")
    heldout_max_batches: int = Field(default=32, ge=0, description="held-out batches scored at the end of a run")
    checkpoint_every: int = Field(default=500, ge=1, description="steps between checkpoints")
    keep_checkpoints: int = Field(default=3, ge=1, description="checkpoints kept in storage, newest first")
    log_every: int = Field(default=10, ge=1, description="steps between log lines and curve points")
    metrics_port: int | None = Field(default=None, description="serve Prometheus metrics on this port (rank 0)")
    cache_dir: str | None = Field(
        default=None, description="local cache of sample files (default EAGLE3_HOME/trainer-cache)"
    )
    cache_budget_bytes: int = Field(
        default=20 * 1024**3, ge=0, description="disk budget of that cache (remote storage only); 0 disables it"
    )
    memory_cache_bytes: int | None = Field(
        default=None,
        ge=0,
        description="host memory for decoded samples, so that later epochs skip the read, sha256 and decode of "
        "what fits (default: a quarter of the memory this process may use, its container's limit or the "
        "machine's); 0 disables it",
    )
    io_threads: int = Field(default=4, ge=1, description="parallel sample reads per process")
    read_processes: int = Field(
        default=0,
        ge=0,
        description="processes that read, verify and decode samples, handing the tensors back in shared memory, so "
        "that the training process keeps its GIL while reading from S3; 0 reads in the training process's threads "
        "(on a 2-core machine reading processes loaded at 0.46x the threads' rate: docs/benchmarks.md)",
    )
    prefetch_groups: int = Field(
        default=2, ge=1, description="optimizer steps' worth of batches loading while the current one trains"
    )
    pool_tokens: int | None = Field(
        default=None, ge=1, description="tokens shuffled and packed together (default 16 x batch tokens)"
    )
    sort_by_length: bool = Field(default=True, description="sort a pool by length before packing (less padding)")
    follow_block_s: float = Field(default=1.0, gt=0, description="how long one wait for new shards blocks")
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="where to train")
    recompute_mlp: bool = Field(
        default=False,
        description="compute each step's MLP activations again in backward instead of keeping them, for long "
        "sequences: 32,768 tokens a micro-batch in 37.4 GiB at Llama-3.1-8B dims on an H100, at 0.94x the speed with "
        "the compiled backbone (about 0.8x eagerly); a run on one GPU switches it on by itself when a micro-batch runs "
        "out of memory",
    )
    compile_backbone: bool | None = Field(
        default=None,
        description="torch.compile the drafter's per-step dense work (norms, projections, MLP); the first steps pay "
        "for the compilation (default: on a CUDA GPU, off on the CPU)",
    )


def compiles_backbone(config: TrainConfig, device_type: str) -> bool:
    """Whether the run compiles the drafter's backbone: as set, else on CUDA, where the compiled step measured
    1.24-1.31x the eager one's tokens/s at Llama-3.1-8B dims at no more peak memory (docs/benchmarks.md), and not on
    the CPU, where compiling would take more of a short run than it gives back."""
    return config.compile_backbone if config.compile_backbone is not None else device_type == "cuda"


# What a resumed run may change; everything else comes from the checkpoint, so the next steps are the same.
RESUME_OVERRIDES = frozenset(
    {
        "follow",
        "epochs",
        "max_steps",
        "max_seconds",
        "checkpoint_every",
        "keep_checkpoints",
        "log_every",
        "metrics_port",
        "cache_dir",
        "cache_budget_bytes",
        "memory_cache_bytes",
        "io_threads",
        "read_processes",
        "prefetch_groups",
        "model_path",
        "device",
        "heldout_max_batches",
        "follow_block_s",
        "recompute_mlp",
        "compile_backbone",
    }
)


def resumed_config(saved: TrainConfig, given: TrainConfig) -> TrainConfig:
    """The saved config, with what a resumed run may change taken from the given one."""
    explicit = given.model_fields_set - {"job_id"}
    ignored = sorted(
        name for name in explicit - RESUME_OVERRIDES - {"run_name"} if getattr(given, name) != getattr(saved, name)
    )
    if ignored:
        logger.warning("resuming: %s kept from the checkpoint (the next steps must not change)", ignored)
    update = {name: getattr(given, name) for name in explicit & RESUME_OVERRIDES}
    return saved.model_copy(update={**update, "run_name": given.run_name})


# ---------------------------------------------------------------------------------------------------------------------
# The command line, generated from the fields

# Flags kept from before the flags were generated.
_ALIASES = {"model_path": ["--model"]}


def add_config_arguments(parser: argparse.ArgumentParser, *, exclude: frozenset[str] = frozenset()) -> None:
    """One `--field-name` flag per TrainConfig field, typed from its annotation, help from its description."""
    for name, info in TrainConfig.model_fields.items():
        if name in exclude:
            continue
        flags = [f"--{name.replace('_', '-')}", *_ALIASES.get(name, [])]
        default = info.get_default(call_default_factory=True)
        help_text = info.description or ""
        if default is not None:
            help_text += f" (default {' '.join(map(str, default)) if isinstance(default, tuple) else default})"
        kind, nargs, choices = _argument_shape(name, info.annotation)
        common: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text}
        if kind is bool:
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, **common)
        else:
            metavar = None if choices else name.upper()  # argparse shows the choices themselves
            parser.add_argument(*flags, type=kind, nargs=nargs, choices=choices, metavar=metavar, **common)


def config_from_args(args: argparse.Namespace, **values: Any) -> TrainConfig:
    """A TrainConfig of the flags given on the command line (plus `values`); a bad value names its flag."""
    given = {name: getattr(args, name) for name in TrainConfig.model_fields if hasattr(args, name)}
    try:
        return TrainConfig(**given, **values)
    except ValidationError as exc:
        problems = "; ".join(
            f"--{str(error['loc'][0]).replace('_', '-')}: {error['msg']}" for error in exc.errors(include_url=False)
        )
        raise ConfigurationError(f"training configuration: {problems}") from None


def _argument_shape(name: str, annotation: Any) -> tuple[type, int | str | None, list[str] | None]:
    """(element type, nargs, choices) for a field annotation; Optional[X] is X (None is the unset default)."""
    if get_origin(annotation) in (Union, types.UnionType):
        (annotation,) = [arg for arg in get_args(annotation) if arg is not type(None)]
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return str, None, [str(arg) for arg in args]
    if origin is tuple:
        return args[0], len(args), None
    if origin is list:
        return args[0], "+", None
    if annotation in (bool, int, float, str):
        return annotation, None, None
    raise TypeError(f"TrainConfig.{name}: no command-line form for {annotation!r}")
