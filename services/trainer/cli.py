"""`eagle3` trainer commands: train (also under torchrun), eval, export."""

import argparse
import json
import os
from pathlib import Path
from typing import Any

from shared.settings import Settings

# argparse destination -> TrainConfig field; only the options given on the command line are passed, so a resumed
# run can tell an explicit value from a default.
_TRAIN_OPTIONS: dict[str, tuple[type, str]] = {
    "model_path": (str, "the target's Hugging Face folder (default: the job's)"),
    "max_steps": (int, "stop after this many optimizer steps"),
    "max_seconds": (float, "time budget of this invocation"),
    "epochs": (int, "passes over the training shards (default 1)"),
    "batch_tokens": (int, "padded B x T of one micro-batch per process (default 8192)"),
    "max_length": (int, "truncate samples to this many tokens (default 2048)"),
    "grad_accum": (int, "micro-batches per process per optimizer step (default 1)"),
    "lr": (float, "peak learning rate (default 1e-4)"),
    "weight_decay": (float, "AdamW weight decay (default 0)"),
    "ttt_length": (int, "unrolled draft steps of the training-time test (default 7)"),
    "schedule_steps": (int, "length of the warmup + cosine schedule (default: max steps or an estimate)"),
    "checkpoint_every": (int, "steps between checkpoints (default 500)"),
    "log_every": (int, "steps between log lines and curve points (default 10)"),
    "run_name": (str, "checkpoints go to JOB/trainer/RUN_NAME/ (default 'default')"),
    "metrics_port": (int, "serve Prometheus metrics on this port (rank 0)"),
    "heldout_fraction": (float, "share of shards held out from training (default 0.05)"),
    "seed": (int, "data order and initial weights (default 0)"),
    "cache_dir": (str, "local cache of sample files (default EAGLE3_HOME/trainer-cache)"),
    "cache_budget_bytes": (int, "disk budget of that cache (default 20 GiB)"),
    "device": (str, "auto, cpu or cuda"),
}


def cmd_train(args: argparse.Namespace, settings: Settings) -> None:
    from services.trainer.train import TrainConfig, train
    from shared.kinds.regenerate import training_job_id
    from shared.storage import open_storage

    given: dict[str, Any] = {name: getattr(args, name) for name in _TRAIN_OPTIONS if getattr(args, name) is not None}
    if args.follow:
        given["follow"] = True
    if args.random_init:
        given["init_from_target"] = False
    # A regenerate job (then_extract) trains on its chained extraction job; following, wait for it to be submitted.
    job_id = training_job_id(
        open_storage(settings.storage_url, settings), args.job, wait_s=float("inf") if args.follow else 0.0
    )
    summary = train(
        TrainConfig(job_id=job_id, **given), settings=settings, resume=args.resume, resume_from=args.resume_from
    )
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({k: v for k, v in summary.items() if k != "history"}, indent=2))


def cmd_eval(args: argparse.Namespace, settings: Settings) -> None:
    from services.trainer.train import evaluate_checkpoint

    result = evaluate_checkpoint(
        args.checkpoint,
        settings=settings,
        job_id=args.job,
        model_path=args.model_path,
        num_prompts=args.prompts,
        num_draft_tokens=args.num_draft_tokens,
        max_new_tokens=args.max_new_tokens,
        max_batches=args.max_batches,
    )
    print(json.dumps(result, indent=2))


def cmd_export(args: argparse.Namespace, settings: Settings) -> None:
    from services.trainer.train import export_checkpoint

    print(export_checkpoint(args.checkpoint, Path(args.out), settings=settings, model_path=args.model_path))


def add_parsers(sub: argparse._SubParsersAction) -> None:
    checkpoint_help = "a local .pt file, a storage key, a latest.json key, or JOB/trainer/RUN (its latest)"

    p = sub.add_parser(
        "train",
        help="train an EAGLE-3 drafter from a job's committed shards",
        description="Also runs under `torchrun --nproc_per_node N -m eagle3 train ...` (DDP).",
    )
    p.add_argument("--job", required=True, help="an extraction job, or a regenerate job with then_extract")
    p.add_argument("--follow", action="store_true", help="keep taking shards as they are committed until the job ends")
    p.add_argument(
        "--random-init", action="store_true", help="start lm_head, norm and fc at random, not from the target's"
    )
    p.add_argument("--resume", action="store_true", help="continue from the run's latest checkpoint, if any")
    p.add_argument("--resume-from", metavar="CHECKPOINT", help=f"continue from this checkpoint: {checkpoint_help}")
    for name, (kind, help_text) in _TRAIN_OPTIONS.items():
        flag = "--model" if name == "model_path" else f"--{name.replace('_', '-')}"
        p.add_argument(flag, dest=name, type=kind, help=help_text)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="held-out and measured acceptance of a checkpoint against an untrained drafter")
    p.add_argument("--checkpoint", required=True, help=checkpoint_help)
    p.add_argument("--job", help="evaluate on this job's held-out shards (default: the checkpoint's job)")
    p.add_argument("--model", dest="model_path", help="the target's folder (default: the one trained with)")
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts to decode speculatively")
    p.add_argument("--num-draft-tokens", type=int, default=7)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-batches", type=int, help="held-out batches to score (default: the run's setting)")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("export", help="export a checkpoint's drafter as an SGLang EAGLE-3 draft model folder")
    p.add_argument("--checkpoint", required=True, help=checkpoint_help)
    p.add_argument("--to", choices=["sglang"], required=True)
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--model", dest="model_path", help="the target's folder (default: the one trained with)")
    p.set_defaults(func=cmd_export)
