"""`eagle3 doctor`: shared/ops/doctor.py's checks, wired here (the composition root) to the trainer's one-step probe."""

import argparse
import tempfile
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from shared.errors import Eagle3Error
from shared.settings import Settings

if TYPE_CHECKING:  # shared.ops.doctor imports torch: every `eagle3` command (the worker probe too) would pay for it
    from shared.ops.doctor import Check

_STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red"}


def train_one_step(job_id: str, settings: Settings) -> str:
    """The trainer's own data loader and training step on the scratch job's committed shard."""
    from services.trainer.config import TrainConfig
    from services.trainer.train import train

    with tempfile.TemporaryDirectory(prefix="eagle3-doctor-cache-") as cache:
        summary = train(
            TrainConfig(
                job_id=job_id,
                run_name="doctor",
                max_steps=1,
                heldout_fraction=0.0,
                cache_dir=cache,
                cache_budget_bytes=0,
                checkpoint_every=1,
                log_every=1,
            ),
            settings=settings,
        )
    if summary["steps"] != 1 or not summary["train_tokens"] or summary["skipped_samples"]:
        raise Eagle3Error(
            f"the trainer did {summary['steps']} step(s) on {summary['train_tokens']} tokens, "
            f"skipping {summary['skipped_samples']} sample(s) ({summary['skipped_by_reason']})"
        )
    return f"loaded {summary['train_tokens']} tokens, 1 step, loss {summary['final_loss']:.3f}"


def print_table(checks: "list[Check]", console: Console) -> None:
    table = Table(title="eagle3 doctor", show_lines=False)
    table.add_column("check")
    table.add_column("result")
    table.add_column("seconds", justify="right")
    table.add_column("detail", overflow="fold")
    for check in checks:
        status = f"[{_STYLE[check.status]}]{check.status.upper()}[/]"
        table.add_row(check.name, status, f"{check.seconds:.1f}", check.detail)
    console.print(table)


def cmd_doctor(args: argparse.Namespace, settings: Settings) -> None:
    from shared.data.model_assets import resolve_model_path
    from shared.ops import doctor

    model = args.model or (str(settings.model_path) if settings.model_path else None)
    if model is None:
        raise SystemExit("error: give --model DIR (or set EAGLE3_MODEL_PATH): the target to check against")
    checks = doctor.run_checks(
        settings,
        model_path=resolve_model_path(model),
        aux_layer_ids=[int(i) for i in args.aux_layer_ids.split(",")] if args.aux_layer_ids else None,
        dataset_url=args.dataset,
        inference_urls=args.inference_url,
        train_probe=None if args.no_train else train_one_step,
        end_to_end=not args.quick,
        keep_scratch=args.keep,
    )
    print_table(checks, Console(width=max(Console().width, 140)))
    failed = [c.name for c in checks if c.status == "fail"]
    if failed:
        raise SystemExit(f"doctor: {len(failed)} check(s) failed: {', '.join(failed)}")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="check Redis, storage, inference servers, layer ids, budget, and one sample end to end before a long run",
    )
    p.add_argument("--model", help="the target's Hugging Face folder (default EAGLE3_MODEL_PATH)")
    p.add_argument("--aux-layer-ids", help="comma-separated layer ids the run will capture (default EAGLE-3's)")
    p.add_argument("--dataset", help="the run's dataset: its size is projected against the budget")
    p.add_argument(
        "--inference-url", action="append", help="an inference server to check (repeat; default EAGLE3_INFERENCE_URL)"
    )
    p.add_argument("--quick", action="store_true", help="skip the end-to-end sample")
    p.add_argument("--no-train", action="store_true", help="end to end without the trainer step")
    p.add_argument("--keep", action="store_true", help="keep the scratch job's files and counters for inspection")
    p.set_defaults(func=cmd_doctor)
