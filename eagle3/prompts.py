"""`eagle3 prompts`: a broad training prompt mix (chat, code, instructions) built offline, for a regenerate job
(shared/data/prompt_mix.py does the work)."""

import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table

from shared.data.prompt_mix import DEFAULT_MIX, SOURCES, PromptMixFiles, build_prompt_mix, parse_mix
from shared.settings import Settings


def print_summary(files: PromptMixFiles, console: Console) -> None:
    table = Table(title="eagle3 prompts")
    table.add_column("file", overflow="fold")
    table.add_column("prompts", justify="right")
    for source in SOURCES:
        table.add_column(source, justify="right")
    train_total = sum(files.train_counts.values())
    table.add_row(str(files.train_path), str(train_total), *(str(files.train_counts[s]) for s in SOURCES))
    table.add_row(str(files.eval_code_path), str(files.eval_code_count), "", str(files.eval_code_count), "")
    table.add_row(str(files.eval_chat_path), str(files.eval_chat_count), str(files.eval_chat_count), "", "")
    console.print(table)
    console.print(f"{files.total_chars:,} characters of user prompts")
    # Every answer in these files is a placeholder: extracted without regeneration, the drafter would learn it.
    console.print(f"next: eagle3 regenerate {files.train_path} --then-extract (the target writes every answer)")
    evals = f"--prompts-file {files.eval_code_path} --prompts-file {files.eval_chat_path}"
    console.print(f"then: eagle3 eval --checkpoint CKPT {evals} (acceptance on held-out prompts)")


def cmd_prompts(args: argparse.Namespace, settings: Settings) -> None:
    files = build_prompt_mix(
        args.out,
        train_prompts=args.train,
        eval_prompts=args.eval,
        seed=args.seed,
        mix=parse_mix(args.mix) if args.mix else None,
    )
    print_summary(files, Console())


def add_parsers(sub: argparse._SubParsersAction) -> None:
    default_mix = ",".join(f"{source}={share:g}" for source, share in DEFAULT_MIX.items())
    p = sub.add_parser(
        "prompts",
        help="write a chat/code/instruction prompt mix for a regenerate job, from installed packages only",
        description="Writes train.jsonl, eval_code.jsonl and eval_chat.jsonl (OpenAI messages) to --out. Every "
        "assistant turn is a placeholder for the target's own answer: regenerate train.jsonl (eagle3 regenerate) "
        "before extraction. The eval sets are single-turn prompts from held-out source files and dialogs, for "
        "eagle3 eval --prompts-file. The same seed, interpreter and installed packages give the same bytes.",
    )
    p.add_argument("--out", type=Path, required=True, help="folder for the three JSONL files")
    p.add_argument("--train", type=int, default=20000, help="training prompts (default 20000)")
    p.add_argument("--eval", type=int, default=32, help="prompts in each held-out eval set (default 32)")
    p.add_argument("--seed", type=int, default=0, help="picks and order (default 0)")
    p.add_argument("--mix", help=f"shares of the training prompts, summing to 1 (default {default_mix})")
    p.set_defaults(func=cmd_prompts)
