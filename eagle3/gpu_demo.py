"""`eagle3 demo --gpu`: the whole product on one GPU machine, as processes.

The stack of the CPU demo with SGLang in place of the reference server: a Redis server, the producer API, N Celery
workers and SGLang with the capture plugin (shared-memory transport). The target regenerates every answer of a
broad prompt mix (chat, code, instructions), the regenerated conversations are extracted, the stack stops so that
the trainer has the GPU to itself, the drafter trains on the GPU, is exported, and SGLang serves it with its own
EAGLE-3 speculative decoding against plain decoding of the same target (`eagle3 eval --engine sglang`) on two
prompt sets training never saw, one of code and one of chat. The report gives each stage's wall time and rate.

    eagle3 demo --gpu                                  # builds the prompt mix from the installed data wheels
    eagle3 demo --gpu --dataset train.jsonl --eval-prompts-file code.jsonl --eval-prompts-file chat.jsonl
"""

import argparse
import json
import math
import multiprocessing
import shlex
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from eagle3 import demo
from eagle3.api import check
from eagle3.demo import apply_defaults, completed_extraction, extraction_spec, regenerate_demo_data
from eagle3.engine_eval import (
    EngineEvalOptions,
    SpeculativeConfig,
    decode_all,
    drafters_from_checkpoint,
    evaluate_on_engine,
    print_engine_report,
    speculative_setting,
)
from eagle3.jobs import console, exit_on_sigterm, watch
from eagle3.local_stack import LocalStack, free_port
from shared.data.datasets import Conversation, read_dataset
from shared.data.model_assets import resolve_model_path
from shared.data.tokenization import ChatTokenizer
from shared.errors import ConfigurationError, Eagle3Error
from shared.settings import Settings
from shared.storage import layout
from shared.storage.objects import open_storage

# The held-out sets are code and chat: most of the mix is too (the CPU default gives instructions a quarter).
GPU_DEMO_MIX = "chat=0.45,code=0.45,instructions=0.1"
SGLANG_START_TIMEOUT_S = 900.0  # kernels compile and CUDA graphs are captured at first start
# Prefill yardstick: 16 waves of the extraction's requests in flight are a steady rate; all 12,000 conversations of
# the 2026-12-05 run took 44 s of a 10-minute command for the same figure.
PREFILL_SAMPLE_WAVES = 16
# Decoding yardstick: two waves of the regeneration's concurrency ended in a tail of a few long turns decoding alone
# (8.4K tokens/s against the job's 24.6K, H200, 2026-12-05); eight are mostly a full batch, as the job is.
DECODE_SAMPLE_WAVES = 8
# A chain of 7 drafts (the project's own decoding is compared with SGLang's there) and a tree as deep: on a small
# target a verify of 16 tokens costs about what one of 8 does, and shorter chains measured no faster (5,1,6 and
# 3,1,4, H200, 2026-12-04). The tree 6,4,16 accepted 3.01 / 3.21 against the chain's 2.36 / 2.74 and served
# faster (H200, 2026-12-05); a seventh step adds candidates for the same 16 verified tokens. A step of this target
# costs 2.5-3 plain tokens whatever it drafts (FA3 or Triton attention, 2026-12-06), so only more accepted tokens a
# step make it faster: the sweep also tries a wider tree (topk 8, 32 verified tokens), since topk 4 already raised the
# first draft position's acceptance from the chain's 0.53 to 0.76 (code, 2026-12-06).
DEFAULT_SWEEP = [SpeculativeConfig(7, 1, 8), SpeculativeConfig(7, 4, 16), SpeculativeConfig(7, 8, 32)]
# Sized for one H200 and a small target: shards of seconds, not milliseconds, of the server's work (docs/benchmarks.md).
GPU_DEFAULTS = {
    "workers": 4,
    "max_length": 2048,
    "shard_token_budget": 65536,
    "draft_vocab_size": 16384,
    # As long as the evaluation decodes: the drafter is judged on answers' first 128 tokens, and for the same GPU
    # time shorter answers are more prompts (18,000 at 128 against 12,000 at 256, 2026-12-05, docs/benchmarks.md).
    "regenerate_max_new_tokens": 128,
    "eval_max_new_tokens": 128,
    "train_batch_tokens": 32768,
    "train_seconds": 300,
}


def cmd_demo(args: argparse.Namespace, settings: Settings) -> None:
    """`eagle3 demo`, on the CPU or with --gpu."""
    if not args.gpu:
        demo.cmd_demo(args, settings)
        return
    apply_defaults(args, GPU_DEFAULTS)
    cmd_demo_gpu(args, settings)


STAGES = ("extraction", "training", "evaluation")


def cmd_demo_gpu(args: argparse.Namespace, settings: Settings) -> None:
    """The stages in order, the report written after each: with --resume, the stages the report already holds are
    not run again (a machine lent for minutes at a time runs one stage per command); --until stops after one."""
    if args.dataset and not args.eval_prompts_file:
        raise SystemExit("--dataset needs --eval-prompts-file: prompt sets that training never saw")
    exit_on_sigterm()
    demo_dir = settings.home / "demo-gpu"
    report_path = Path(args.report) if args.report else demo_dir / "report.json"
    report = resumed_report(report_path) if args.resume else {}
    model = resolve_model_path(args.model).resolve()
    if "extraction" not in report:
        dataset, eval_files = prompt_files(args, demo_dir)
        report.update(model=str(model), dataset=str(dataset), eval_files=[str(f) for f in eval_files])
        console.print(
            f"[bold]1/5[/] model {model}\n      prompts {dataset}, held out: {', '.join(map(str, eval_files))}"
        )
        report.update(
            extract_through_the_stack(
                args, settings, demo_dir, model, dataset, save=lambda part: write_report(report_path, report | part)
            )
        )
        write_report(report_path, report)
    else:
        console.print(f"[bold]1-3/5[/] extraction job {report['extraction']['job_id']}: done before ({report_path})")
    if args.until == "extraction":
        return
    if "training" not in report:
        console.print(f"[bold]4/5[/] training the drafter on the GPU (at most {args.train_seconds:.0f} s)")
        report["training"] = train_and_export(report["extraction"]["job_id"], settings, args, demo_dir)
        write_report(report_path, report)  # what was made so far stays, whatever the evaluation does
    else:
        console.print(f"[bold]4/5[/] drafter {report['training']['checkpoint']}: trained before")
    if args.until == "training":
        return

    console.print("[bold]5/5[/] serving it with SGLang's EAGLE-3 against plain SGLang")
    eval_started = time.monotonic()
    drafters = drafters_from_checkpoint(
        report["training"]["checkpoint"], settings=settings, model_path=str(model), baseline=args.eval_baseline
    )
    engine = evaluate_on_engine(
        drafters,
        [Path(f) for f in report["eval_files"]],
        options=EngineEvalOptions(
            settings=args.speculative or DEFAULT_SWEEP,
            max_new_tokens=args.eval_max_new_tokens,
            concurrency=args.eval_concurrency,
            sglang_python=args.sglang_python,
            sglang_args=shlex.split(args.eval_sglang_args),
            work_dir=demo_dir / "engine-eval",
            resume=args.resume,  # an evaluation a command's time limit cut short goes on where it stopped
            # The project's own decoding beside SGLang's for the trained drafter only: the untrained one accepts almost
            # nothing, so its Python decoding loop takes the most steps of all (minutes of the stage on a GPU).
            own_drafters=("trained",),
            compare_own=args.eval_own,
        ),
    )
    report["engine_eval"] = engine
    report["engine_eval_seconds"] = round(time.monotonic() - eval_started, 1)
    print_engine_report(engine, console)
    console.print(stage_summary(report))
    write_report(report_path, report)
    console.print(f"report written to {report_path}")


def resumed_report(path: Path) -> dict[str, Any]:
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"--resume: no report at {path} (a run writes it after each stage)") from None
    if not isinstance(report, dict):
        raise SystemExit(f"--resume: {path} is not a demo report")
    return report


def extract_through_the_stack(
    args: argparse.Namespace,
    settings: Settings,
    demo_dir: Path,
    model: Path,
    dataset: Path,
    save: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """Stages 2 and 3: the stack up, every answer regenerated, the result extracted, SGLang's own rates on the same
    work measured on the same server; the stack stops so that the trainer has the GPU to itself. The completed
    extraction is saved before the yardstick: a command's time limit that cuts the yardstick short leaves a job that
    `--resume` trains from (an H100's stack started in 176 s and left the yardstick no time, 2026-12-06)."""
    settings = gpu_stack_settings(
        settings,
        model=model,
        work_dir=demo_dir,
        dataset=dataset,
        inference_concurrency=args.inference_concurrency,
        regenerate_concurrency=args.regenerate_concurrency,
        write_concurrency=args.write_concurrency,
    )
    report: dict[str, Any] = {}
    inference_argv = capture_server_argv(args)
    extraction = extraction_spec(args, dataset, model)
    try:
        console.print(f"[bold]2/5[/] the stack: SGLang with the capture plugin, {args.workers} workers")
        stack_started = time.monotonic()
        with LocalStack(
            settings,
            workers=args.workers,
            log_dir=demo_dir / "logs",
            pick_free_ports=True,
            inference_argv=inference_argv,
            inference_ready_timeout_s=SGLANG_START_TIMEOUT_S,
            extra_env={"EAGLE3_SGLANG_MEM_FRACTION_STATIC": str(args.mem_fraction_static)},
        ) as stack:
            report["stack_start_seconds"] = round(time.monotonic() - stack_started, 1)
            with stack.api_client() as api:
                if args.regenerate_shard_size is None:
                    with dataset.open("rb") as lines:
                        conversations = sum(1 for line in lines if line.strip())
                    args.regenerate_shard_size = regeneration_shard_size(
                        conversations, args.workers, args.regenerate_concurrency
                    )
                console.print(
                    f"[bold]3/5[/] regenerating every answer (greedy, <= {args.regenerate_max_new_tokens} tokens, "
                    f"shards of {args.regenerate_shard_size} conversations)"
                )
                report["regeneration"] = regenerate_demo_data(api, extraction, settings, stack, args)
                job_id = report["regeneration"]["chained_job_id"]
                console.print("      extracting the regenerated conversations")
                extract_started = time.monotonic()
                job = check(api.get(f"/v1/jobs/{job_id}"))["job"]
                p = watch(job_id, api, alive=stack)
                extract_seconds = time.monotonic() - extract_started
            report["extraction"] = completed_extraction(p, job, settings, model, extract_seconds, args.workers)
            save(report)
            console.print("      SGLang's own decoding and prefill of the same work, driven directly")
            try:
                report["sglang_baseline"] = sglang_baselines(
                    stack.env["EAGLE3_INFERENCE_URL"],
                    read_regenerated(settings, report["regeneration"]["job_id"]),
                    model,
                    client_processes=args.workers,
                    decode_concurrency=args.workers * args.regenerate_concurrency,
                    prefill_concurrency=args.workers * args.inference_concurrency,
                    max_new_tokens=args.regenerate_max_new_tokens,
                    max_length=args.max_length,
                )
            except (httpx.HTTPError, Eagle3Error) as exc:  # a yardstick: the job it measures stands without it
                console.print(f"      [yellow]SGLang's own rates not measured: {exc!r}[/]")
                report["sglang_baseline"] = {"error": repr(exc)}
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except Eagle3Error as exc:
        raise SystemExit(f"demo failed: {exc}") from exc
    return report


def gpu_stack_settings(
    settings: Settings,
    *,
    model: Path,
    work_dir: Path,
    dataset: Path,
    inference_concurrency: int,
    regenerate_concurrency: int,
    write_concurrency: int,
) -> Settings:
    """The stack's settings on one GPU machine: states through shared memory under `work_dir`, the dataset's folder
    and `work_dir` readable by the producer, and a Redis of its own on a free port unless one was configured."""
    shm_dir = work_dir / "shm"
    shm_dir.mkdir(parents=True, exist_ok=True)
    roots = {str(dataset.parent.resolve()), str(work_dir.resolve())}
    return settings.model_copy(
        update={
            "model_path": model,
            "dataset_roots": [*settings.dataset_roots, *sorted(roots)],
            "capture_transport": "shm",
            "shm_dir": shm_dir,
            "inference_concurrency": inference_concurrency,
            "regenerate_concurrency": regenerate_concurrency,
            "write_concurrency": write_concurrency,
            **({} if "redis_url" in settings.model_fields_set else {"redis_url": f"redis://127.0.0.1:{free_port()}/0"}),
        }
    )


def regeneration_shard_size(conversations: int, workers: int, concurrency: int) -> int:
    """Conversations per regeneration shard when --regenerate-shard-size is not given: up to four times what a
    worker decodes at once, and at least two shards per worker so that none idles while the others work.

    A shard the size of the worker's thread pool (128 / 128 on the H200, 2026-12-04) left each worker waiting on
    its longest multi-turn chat, four answers one after another, with most threads idle: a third of the server's
    batch on average, 13.4K tokens/s. With more conversations queued than threads, a finished conversation's
    thread takes the next one, and only the shard's last chains run alone."""
    return max(1, min(4 * concurrency, math.ceil(conversations / (2 * workers))))


def capture_server_argv(args: argparse.Namespace) -> list[str]:
    """SGLang with the capture plugin, its decode CUDA graphs covering every request the regeneration keeps in
    flight: SGLang 0.5.23 captures graphs up to 256 requests, and beyond that decoded eagerly, several times slower a
    step (on the H200, 2026-12-03: 10.4K tokens/s with 385 requests running without graphs, up to 31K with them at
    256 or fewer). A graph size given in --sglang-args wins."""
    extra = shlex.split(args.sglang_args)
    if not any(arg.startswith(("--cuda-graph-max-bs", "--cuda-graph-bs")) for arg in extra):
        extra += ["--cuda-graph-max-bs-decode", str(args.workers * args.regenerate_concurrency)]
    return [args.sglang_python, "-m", "eagle3_sglang_plugin.launch", *extra]


def write_report(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def read_regenerated(settings: Settings, regenerate_job_id: str) -> list[Conversation]:
    """The regenerate job's assembled output, the conversations the extraction job read."""
    data = open_storage(settings.storage_url, settings).get(layout.regenerated_dataset(regenerate_job_id))
    return [record for record in read_dataset(data.splitlines()) if isinstance(record, Conversation)]


def sglang_baselines(
    url: str,
    conversations: list[Conversation],
    model: Path,
    *,
    client_processes: int,
    decode_concurrency: int,
    prefill_concurrency: int,
    max_new_tokens: int,
    max_length: int,
) -> dict[str, Any]:
    """SGLang's own rates on the demo's work, on the same server with no queue, worker or storage in between:
    greedy decoding of the regenerated turns' prompts at the regeneration's concurrency (a sample of
    DECODE_SAMPLE_WAVES times that many turns, longest prompts first, as the workers order them), and the prefill
    (one new token) of the extracted conversations at the extraction's concurrency (every one, up to
    PREFILL_SAMPLE_WAVES times that concurrency: an even sample of them beyond). The requests go out from as many
    client processes as the job has workers, so that no one Python process is the bound the job does not have. The
    stages' rates over these are the stack's cost."""
    chat = ChatTokenizer.from_pretrained(model)
    turns = [
        chat.generation_prompt(conv, conv.messages[:index])
        for conv in conversations
        for index, message in enumerate(conv.messages)
        if message.role == "assistant"
    ]
    turns = sorted(turns[: DECODE_SAMPLE_WAVES * decode_concurrency], key=len, reverse=True)
    decode = send_from_processes(
        url, turns, max_new_tokens=max_new_tokens, processes=client_processes, concurrency=decode_concurrency
    )
    every = max(1, math.ceil(len(conversations) / (PREFILL_SAMPLE_WAVES * prefill_concurrency)))
    sequences = [
        chat.tokenize(conv, max_length=max_length, length_policy="truncate").input_ids
        for conv in conversations[::every]
    ]
    prefill = send_from_processes(
        url, sequences, max_new_tokens=1, processes=client_processes, concurrency=prefill_concurrency
    )
    prompt_tokens = sum(len(sequence) for sequence in sequences)
    return {
        "client_processes": decode.processes,
        "decode_turns": len(turns),
        "decode_concurrency": decode_concurrency,
        "decode_generated_tokens": decode.generated_tokens,
        "decode_tokens_per_second": round(decode.generated_tokens / decode.wall_seconds, 1),
        # The clients' own CPU seconds a wall second, all processes together: near their count, they may still be
        # what bounds the yardstick.
        "decode_client_cpu_share": round(decode.client_cpu_seconds / decode.wall_seconds, 2),
        "prefill_conversations": len(sequences),
        "prefill_concurrency": prefill_concurrency,
        "prefill_tokens": prompt_tokens,
        "prefill_tokens_per_second": round(prompt_tokens / prefill.wall_seconds, 1),
    }


@dataclass(frozen=True)
class ClientRun:
    """Requests sent by several client processes together."""

    processes: int
    generated_tokens: int  # over every answer
    wall_seconds: float  # from the moment every process was ready to the last answer
    client_cpu_seconds: float  # the processes' own CPU time (all their threads) while they sent and waited


CLIENT_READY_TIMEOUT_S = 300.0  # a client process that does not start in this time fails the yardstick, not the demo
_ready: Any = None  # in a client process: the barrier every client passes before its first request


def send_from_processes(
    url: str, prompts: list[list[int]], *, max_new_tokens: int, processes: int, concurrency: int
) -> ClientRun:
    """Every prompt sent greedily by `processes` client processes at once, `concurrency` requests in flight over
    them all; the prompts are dealt in turn, so an order (longest first, say) holds in each. Timed from a barrier all
    of them pass after starting, so their start-up is not the server's time."""
    processes = max(1, min(processes, len(prompts)))
    each = max(1, math.ceil(concurrency / processes))
    context = multiprocessing.get_context("spawn")  # the demo process has threads: a fork would copy their locks
    ready = context.Barrier(processes)
    with ProcessPoolExecutor(processes, mp_context=context, initializer=_keep_barrier, initargs=(ready,)) as pool:
        parts = [pool.submit(_send_part, url, prompts[i::processes], max_new_tokens, each) for i in range(processes)]
        try:
            results = [part.result() for part in parts]
        except threading.BrokenBarrierError as exc:
            raise Eagle3Error(
                f"a yardstick client process did not start within {CLIENT_READY_TIMEOUT_S:.0f} s"
            ) from exc
    return ClientRun(
        processes=processes,
        generated_tokens=sum(generated for _, _, generated, _ in results),
        wall_seconds=max(ended for _, ended, _, _ in results) - min(started for started, _, _, _ in results),
        client_cpu_seconds=sum(cpu for _, _, _, cpu in results),
    )


def _keep_barrier(barrier: Any) -> None:
    global _ready
    _ready = barrier


def _send_part(
    url: str, prompts: list[list[int]], max_new_tokens: int, concurrency: int
) -> tuple[float, float, int, float]:
    """In a client process: (start, end on the machine's monotonic clock, new tokens, this process's CPU seconds)."""
    _ready.wait(timeout=CLIENT_READY_TIMEOUT_S)
    cpu_started, started = time.process_time(), time.monotonic()
    try:
        completions, _ = decode_all(url, prompts, max_new_tokens=max_new_tokens, concurrency=concurrency)
    except httpx.HTTPError as exc:  # httpx's errors do not cross back to the parent process (their request does not)
        raise Eagle3Error(f"SGLang at {url}: {exc!r}") from None
    ended = time.monotonic()
    return started, ended, sum(len(c.output_ids) for c in completions), time.process_time() - cpu_started


def prompt_files(args: argparse.Namespace, demo_dir: Path) -> tuple[Path, list[Path]]:
    """The training prompts and the held-out evaluation sets: given, or the mix built from installed packages."""
    if args.dataset:
        return Path(args.dataset).resolve(), [Path(f).resolve() for f in args.eval_prompts_file]
    from shared.data.prompt_mix import build_prompt_mix, parse_mix

    try:
        mix = build_prompt_mix(
            demo_dir / "prompts",
            train_prompts=args.prompts,
            eval_prompts=args.holdout_prompts,
            mix=parse_mix(args.mix),
        )
    except ConfigurationError as exc:
        raise SystemExit(f"demo failed: {exc}") from exc
    return mix.train_path.resolve(), [mix.eval_code_path.resolve(), mix.eval_chat_path.resolve()]


def train_and_export(job_id: str, settings: Settings, args: argparse.Namespace, demo_dir: Path) -> dict[str, Any]:
    from services.trainer.config import TrainConfig
    from services.trainer.data import usable_memory_bytes
    from services.trainer.export import export_checkpoint
    from services.trainer.train import train

    config = TrainConfig(
        job_id=job_id,
        run_name="demo-gpu",
        device="cuda" if not args.train_on_cpu else "cpu",
        max_seconds=args.train_seconds,
        epochs=args.train_epochs,
        batch_tokens=args.train_batch_tokens,
        max_length=args.max_length,
        lr=args.train_lr,
        heldout_fraction=0.02,
        # GPU utilisation swung between 20% and 85% with 4 reader threads on the H200 (2026-12-03): feed it wider.
        io_threads=16,
        # The machine is the demo's alone: half its memory keeps an 18,000-prompt job's samples (30 GB) after their
        # first read (the readers' unpickling held the GIL the step launches its kernels with: 88-92K tokens/s in
        # the first epoch, 140-145K from memory, H100, 2026-12-05).
        memory_cache_bytes=usable_memory_bytes() // 2,
        checkpoint_every=10**6,  # one checkpoint, at the end
        log_every=50,
    )
    started = time.monotonic()
    summary = train(config, settings=settings)
    seconds = time.monotonic() - started
    export_dir = export_checkpoint(summary["checkpoint_key"], demo_dir / "drafter-sglang", settings=settings)
    return {
        "checkpoint": summary["checkpoint_key"],
        "steps": summary["steps"],
        "train_tokens": summary["train_tokens"],
        "train_seconds": summary["train_seconds"],
        "wall_seconds": round(seconds, 1),
        "tokens_per_second": round(summary["train_tokens"] / max(summary["train_seconds"], 1e-9), 1),
        "data_wait_seconds": round(sum(point["data_wait_seconds"] for point in summary["history"]), 1),
        "memory_cache": summary["memory_cache"],
        "heldout": {k: v for k, v in (summary.get("heldout") or {}).items() if k != "loss_per_position"},
        "export_dir": str(export_dir.resolve()),
    }


def stage_summary(report: dict[str, Any]) -> str:
    regeneration, extraction, training = report["regeneration"], report["extraction"], report["training"]
    baseline = report.get("sglang_baseline") or {}

    def against(rate: float, key: str, what: str) -> str:
        own = baseline.get(key)
        return f"  {rate / own:.2f}x SGLang's own {what} ({own:,.0f} tok/s)" if own else ""

    client_cpu = baseline.get("decode_client_cpu_share")
    decode_client = f", its client at {client_cpu:.2f} CPU-seconds a second" if client_cpu is not None else ""

    lines = [
        f"stack start       {report['stack_start_seconds']:>8.1f} s",
        f"regeneration      {regeneration['wall_seconds']:>8.1f} s  {regeneration['generated_tokens']:>10,} tokens  "
        f"{regeneration['generated_tokens_per_second']:>10,.0f} tok/s generated"
        + against(regeneration["generated_tokens_per_second"], "decode_tokens_per_second", "decoding")
        + decode_client,
        f"extraction        {extraction['wall_seconds']:>8.1f} s  {extraction['tokens_committed']:>10,} tokens  "
        f"{extraction['tokens_per_second']:>10,.0f} tok/s captured and committed"
        + against(extraction["tokens_per_second"], "prefill_tokens_per_second", "prefill"),
        f"training          {training['wall_seconds']:>8.1f} s  {training['train_tokens']:>10,} tokens  "
        f"{training['tokens_per_second']:>10,.0f} tok/s ({training['steps']} steps)",
        f"engine evaluation {report['engine_eval_seconds']:>8.1f} s",
    ]
    # The stages may have run in several commands (--resume): their sum, not one wall clock.
    total = report["stack_start_seconds"] + regeneration["wall_seconds"] + extraction["wall_seconds"]
    total += training["wall_seconds"] + report["engine_eval_seconds"]
    lines.append(f"the stages         {total:>8.1f} s")
    return "\n".join(lines)


def add_gpu_arguments(demo_parser: argparse.ArgumentParser) -> None:
    """`eagle3 demo --gpu` and its options (the CPU demo's --model, --workers, --max-length, --draft-vocab-size,
    --shard-token-budget, --report, --regenerate-max-new-tokens and --regenerate-shard-size apply too)."""
    group = demo_parser.add_argument_group("GPU demo (--gpu)")
    group.add_argument("--gpu", action="store_true", help="the whole pipeline on this machine's GPU with SGLang")
    group.add_argument("--dataset", help="training prompts (any dataset format); default: the built prompt mix")
    group.add_argument("--eval-prompts-file", action="append", help="a held-out prompt set; repeat")
    group.add_argument("--prompts", type=int, default=18000, help="training prompts of the built mix")
    group.add_argument("--mix", default=GPU_DEMO_MIX, help=f"shares of the built mix (default {GPU_DEMO_MIX})")
    group.add_argument("--holdout-prompts", type=int, default=32, help="prompts per held-out set of the built mix")
    group.add_argument("--sglang-python", default=sys.executable, help="the Python that has SGLang and the plugin")
    group.add_argument("--sglang-args", default="", help="more arguments for the capture server's SGLang")
    group.add_argument("--eval-sglang-args", default="", help="more arguments for the evaluation's SGLang servers")
    group.add_argument("--mem-fraction-static", type=float, default=0.5, help="the capture server's GPU memory share")
    group.add_argument("--inference-concurrency", type=int, default=32, help="capture requests in flight per worker")
    group.add_argument("--regenerate-concurrency", type=int, default=128, help="conversations decoded per shard task")
    group.add_argument("--write-concurrency", type=int, default=8, help="sample writer threads per worker")
    group.add_argument("--train-epochs", type=int, default=20, help="passes over the data within --train-seconds")
    group.add_argument("--train-on-cpu", action="store_true", help="train on the CPU (a smoke test of the flow)")
    group.add_argument(
        "--speculative",
        action="append",
        type=speculative_setting,
        metavar="STEPS,TOPK,DRAFT_TOKENS",
        help="serving settings to evaluate (default 7,1,8 and the trees 7,4,16 and 7,8,32); repeat to sweep",
    )
    group.add_argument("--eval-concurrency", type=int, default=16)
    # Each costs GPU minutes a lent machine may not have: a server start (1-3 minutes) for the untrained drafter, and
    # the project's own one-prompt-at-a-time decoding of both prompt sets (2-4 minutes, 2026-12-06).
    group.add_argument(
        "--no-baseline",
        dest="eval_baseline",
        action="store_false",
        help="leave the untrained drafter out of the evaluation (it accepted 1.03-1.04 tokens a step in every run)",
    )
    group.add_argument(
        "--no-own-eval",
        dest="eval_own",
        action="store_false",
        help="leave out the project's own speculative decoding beside SGLang's",
    )
    group.add_argument(
        "--resume",
        action="store_true",
        help="skip the stages the report (--report) already holds, run the rest; an evaluation cut short goes on "
        "from what it measured",
    )
    group.add_argument("--until", choices=STAGES, default="evaluation", help="stop after this stage")
    demo_parser.set_defaults(func=cmd_demo)
