"""`eagle3` trainer commands: train (also under torchrun), eval, export."""

import argparse
import json
import os
from pathlib import Path

from rich.console import Console

from services.trainer.config import add_config_arguments
from shared.errors import ConfigurationError
from shared.settings import Settings


def cmd_train(args: argparse.Namespace, settings: Settings) -> None:
    from services.trainer.config import config_from_args
    from services.trainer.distributed import end_gloo_rank
    from services.trainer.train import train
    from shared.lifecycle.kinds import kind_of
    from shared.lifecycle.shards import load_job
    from shared.storage.objects import open_storage

    # The job's kind names the job to train on (a regenerate job: its chained extraction job); following, wait for
    # it to be submitted.
    storage = open_storage(settings.storage_url, settings)
    job = load_job(storage, args.job)
    job_id = kind_of(job.kind).training_job(
        storage, job, wait_s=float("inf") if getattr(args, "follow", False) else 0.0
    )
    summary = train(
        config_from_args(args, job_id=job_id), settings=settings, resume=args.resume, resume_from=args.resume_from
    )
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({k: v for k, v in summary.items() if k != "history"}, indent=2))
    end_gloo_rank()


def cmd_eval(args: argparse.Namespace, settings: Settings) -> None:
    from services.trainer import evaluate

    if args.checkpoint is None:
        raise ConfigurationError("eval: give --checkpoint")
    if not args.prompts_file:
        result = evaluate.evaluate_checkpoint(
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
        return
    report = evaluate.evaluate_prompt_files(
        args.checkpoint,
        [Path(file) for file in args.prompts_file],
        settings=settings,
        model_path=args.model_path,
        baseline=args.baseline,
        max_prompts=args.max_prompts,
        num_draft_tokens=args.num_draft_tokens,
        max_new_tokens=args.max_new_tokens,
    )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        Console().print(evaluate.acceptance_table(report))


def cmd_export(args: argparse.Namespace, settings: Settings) -> None:
    from services.trainer.export import export_checkpoint

    out = export_checkpoint(
        args.checkpoint,
        Path(args.out),
        settings=settings,
        model_path=args.model_path,
        engine=args.to,
        verifier=args.verifier,
    )
    print(out)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    checkpoint_help = "a local .pt file, a storage key, a latest.json key, or JOB/trainer/RUN (its latest)"

    p = sub.add_parser(
        "train",
        help="train an EAGLE-3 drafter from a job's committed shards",
        description="Also runs under `torchrun --nproc_per_node N -m eagle3 train ...` (DDP).",
    )
    p.add_argument("--job", required=True, help="an extraction job, or a regenerate job with then_extract")
    p.add_argument("--resume", action="store_true", help="continue from the run's latest checkpoint, if any")
    p.add_argument("--resume-from", metavar="CHECKPOINT", help=f"continue from this checkpoint: {checkpoint_help}")
    add_config_arguments(p, exclude=frozenset({"job_id"}))
    p.add_argument(
        "--random-init",
        dest="init_from_target",
        action="store_false",
        default=argparse.SUPPRESS,
        help="the same as --no-init-from-target",
    )
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
        "eval",
        help="measured acceptance of a checkpoint: on prompt files, or on its job's held-out shards",
        description="With --prompts-file: speculative decoding of every prompt in each file (any dataset format "
        "the pipeline reads; the conversation before each assistant turn is a prompt), one table. Without: "
        "held-out accuracy, simulated and measured acceptance on the job's held-out shards, against an untrained "
        "drafter, as JSON.",
    )
    p.add_argument("--checkpoint", help=checkpoint_help + " (needed unless --engine sglang --drafter DIR)")
    p.add_argument(
        "--prompts-file",
        action="append",
        metavar="FILE.jsonl",
        help="decode the prompts of this dataset file; repeat for several files",
    )
    p.add_argument(
        "--baseline", action="store_true", help="with --prompts-file: also the untrained (warm-start) drafter"
    )
    p.add_argument(
        "--max-prompts", type=int, help="with --prompts-file: the first N prompts of each file (default all)"
    )
    p.add_argument("--json", action="store_true", help="with --prompts-file: print JSON instead of a table")
    p.add_argument("--job", help="evaluate on this job's held-out shards (default: the checkpoint's job)")
    p.add_argument("--model", dest="model_path", help="the target's folder (default: the one trained with)")
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts to decode speculatively")
    p.add_argument("--num-draft-tokens", type=int, default=7, help="drafts per verification step (default 7)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt (default 64)")
    p.add_argument("--max-batches", type=int, help="held-out batches to score (default: the run's setting)")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser(
        "export", help="export a checkpoint's drafter as an EAGLE-3 draft model folder for SGLang or vLLM"
    )
    p.add_argument("--checkpoint", required=True, help=checkpoint_help)
    p.add_argument("--to", choices=["sglang", "vllm"], required=True, help="vllm: the speculators format")
    p.add_argument("--verifier", help="vllm: the target as vLLM is given it (default: the target's folder)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--model", dest="model_path", help="the target's folder (default: the one trained with)")
    p.set_defaults(func=cmd_export)
