"""A whole extraction job through the stack against SGLang's own prefill of the same sequences, in one command.

The stack runs as `eagle3 demo --gpu` runs it (producer API, Redis, --workers Celery workers, the capture server,
local storage, states through shared memory). Each repeat submits the same extraction job through the API (--prompts
records of about --prompt-tokens tokens: the benchmarks' random token ids as preformatted text), reads the job's own
rate once it has completed (tokens committed over the time from its creation to its last commit, what `eagle3
progress` shows) and its timeline from its manifests (when each worker started and committed each shard: where the
job's time beside the server's prefill went), and deletes it (a Llama-8B job stores 32 KB a token); its shards are
sized as a GPU job's should be, seconds of the server's work (--shard-tokens, default two a worker's pool process); then
the server's own prefill (one new token) of the very sequences the job extracted, at the concurrency the workers
keep in flight, on the same server with nothing in between. Repeats alternate the two, after one small job and
prefill that warm the workers and the server; the table has the medians and their ratio.

    python -m bench.stack_extract --model llama-3.1-8b-random --prompts 192 --prompt-tokens 2048 --sglang \\
        --sglang-args "--disable-radix-cache" --repeats 3 --json stack_extract.json

--model is llama-3.1-8b-random (Llama-3.1-8B's shape with random weights: SGLang draws them, `--load-format
dummy`, so the folder under --work-dir holds only the config and a tokenizer), smollm2 or a model folder. Without
--sglang the capture server is the project's reference server: the same command as a smoke test on a CPU.
"""

import argparse
import json
import math
import shlex
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from transformers import AutoTokenizer

from bench.capture_model import RANDOM_8B, bench_prompts, capture_model, random_llama_8b
from eagle3.api import check, read_progress
from eagle3.engine_eval import decode_all
from eagle3.gpu_demo import SGLANG_START_TIMEOUT_S, gpu_stack_settings
from eagle3.jobs import exit_on_sigterm
from eagle3.local_stack import LocalStack
from shared.data.datasets import Conversation, read_dataset
from shared.data.tokenization import ChatTokenizer
from shared.lifecycle.schemas import Manifest
from shared.settings import Settings
from shared.storage import layout
from shared.storage.objects import Storage, open_storage

console = Console()
POLL_S = 0.2
JOB_TIMEOUT_S = 1800.0


def write_dataset(path: Path, model_dir: Path, *, prompts: int, prompt_tokens: int, vocab_size: int) -> Path:
    """The capture benchmarks' random token ids as preformatted text records (the job tokenizes them again)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab = min(vocab_size, len(tokenizer))
    lines = [json.dumps({"text": tokenizer.decode(ids)}) for ids in bench_prompts(prompts, prompt_tokens, vocab)]
    path.write_text("\n".join(lines) + "\n")
    return path


def job_sequences(dataset: Path, model_dir: Path, max_length: int) -> list[list[int]]:
    """The token ids the job extracts from `dataset`: the producer's own tokenization of each record."""
    chat = ChatTokenizer.from_pretrained(model_dir)
    records = [r for r in read_dataset(dataset.read_text().splitlines()) if isinstance(r, Conversation)]
    return [chat.tokenize(r, max_length=max_length, length_policy="truncate").input_ids for r in records]


def shard_timeline(storage: Storage, job_id: str) -> dict[str, Any]:
    """Where a completed job's time went, from its job.json and its shards' manifests (each stamped by its worker:
    started, committed, seconds capturing and writing), in seconds from the job record's creation (job.json's
    `created_at`, taken as its planning ends; its rate counts from its publishing, a little later): to its first
    shard's start, each shard's span and how much of it was the captures and writes, and each worker's time between
    its shards and after its last one, up to the job's last commit. What a job pays beside the server's own prefill
    is among these."""
    created = datetime.fromisoformat(json.loads(storage.get(layout.job_json(job_id)))["created_at"]).timestamp()
    manifests = [
        Manifest.model_validate_json(storage.get(key)) for key in storage.list(layout.manifests_prefix(job_id))
    ]
    spans = sorted(
        (
            m.worker,
            datetime.fromisoformat(m.started_at).timestamp() - created,
            datetime.fromisoformat(m.committed_at).timestamp() - created,
            m.timings_s.get("capture_and_write", math.nan),
        )
        for m in manifests
    )
    end = max(committed for _, _, committed, _ in spans)
    workers: dict[str, dict[str, float]] = {}
    for worker in sorted({worker for worker, *_ in spans}):
        # A worker of several pool processes runs shards side by side: its time with no shard open is what is left
        # of its span once the union of its shards' spans is taken out.
        first, covered, reach = math.inf, 0.0, -math.inf
        for _, started, committed, _ in (span for span in spans if span[0] == worker):  # sorted by start
            first = min(first, started)
            covered += max(0.0, committed - max(started, reach))
            reach = max(reach, committed)
        workers[worker] = {
            "first_start_s": first,
            "between_shards_s": reach - first - covered,
            "last_commit_s": reach,
            "after_last_shard_s": end - reach,
        }
    return {
        "first_shard_start_s": min(started for _, started, _, _ in spans),
        "last_commit_s": end,
        "shards": [
            {"worker": worker, "started_s": started, "committed_s": committed, "capture_and_write_s": capture}
            for worker, started, committed, capture in spans
        ],
        "workers": workers,
    }


def describe_timeline(t: dict[str, Any]) -> str:
    shards, workers = t["shards"], t["workers"].values()
    spans = [s["committed_s"] - s["started_s"] for s in shards]
    outside = [s["committed_s"] - s["started_s"] - s["capture_and_write_s"] for s in shards]
    return (
        f"  {t['first_shard_start_s']:.2f} s from the job's creation to its first shard; shards of "
        f"{min(spans):.2f}-{max(spans):.2f} s, {min(outside):.2f}-{max(outside):.2f} s of each outside its captures "
        f"and writes; a worker's time between its shards {max(w['between_shards_s'] for w in workers):.2f} s at most, "
        f"idle at the end {max(w['after_last_shard_s'] for w in workers):.2f} s at most; last commit at "
        f"{t['last_commit_s']:.2f} s"
    )


def run_job(api: Any, spec: dict[str, Any], storage: Storage) -> dict[str, Any]:
    """One extraction job from submission to completion; its own rate and timeline, then it is deleted."""
    submitted = time.monotonic()
    job_id = check(api.post("/v1/jobs", json=spec))["job"]["job_id"]
    deadline = submitted + JOB_TIMEOUT_S
    while not (p := read_progress(api, job_id)).finished:
        if time.monotonic() > deadline:
            raise SystemExit(f"job {job_id} did not finish in {JOB_TIMEOUT_S:.0f} s: {p.state}")
        time.sleep(POLL_S)
    seen_finished_s = time.monotonic() - submitted
    if p.state != "completed":
        letters = check(api.get(f"/v1/jobs/{job_id}/details"))["dead_letters"]
        reasons = "".join(f"\n  shard {d['shard_index']}: {d['error_type']}: {d['reason']}" for d in letters[:3])
        raise SystemExit(f"job {job_id} ended {p.state}{reasons}")
    result = {
        "job_id": job_id,
        "samples": p.samples_done,
        "tokens": p.tokens_done,
        "shards": p.shards_committed,
        "seconds": p.elapsed_seconds,
        "tokens_per_second": p.tokens_per_second,
        "seconds_until_seen_finished": round(seen_finished_s, 3),
        "timeline": shard_timeline(storage, job_id),
    }
    check(api.delete(f"/v1/jobs/{job_id}"))
    return result


def prefill(url: str, sequences: list[list[int]], concurrency: int) -> dict[str, Any]:
    _, seconds = decode_all(url, sequences, max_new_tokens=1, concurrency=concurrency)
    tokens = sum(len(s) for s in sequences)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds}


def print_table(report: dict[str, Any]) -> None:
    table = Table(
        title=f"extraction of {report['prompts']} prompts ({report['tokens']:,} tokens, shards of "
        f"{report['shard_tokens']:,}), {report['model']}"
    )
    for column in ("measure", "tokens/s (median)", "runs", "ratio"):
        table.add_column(column, justify="left" if column == "measure" else "right")
    job, engine = report["job_tokens_per_second"], report["prefill_tokens_per_second"]
    table.add_row(
        f"extraction job through the stack ({report['workers']} workers)",
        f"{job:,.0f}",
        ", ".join(f"{r['job']['tokens_per_second']:,.0f}" for r in report["repeats"]),
        f"{report['ratio']:.3f}",
    )
    table.add_row(
        f"the server's own prefill, same sequences, {report['prefill_concurrency']} in flight",
        f"{engine:,.0f}",
        ", ".join(f"{r['prefill']['tokens_per_second']:,.0f}" for r in report["repeats"]),
        "1.000",
    )
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.1-8b-random", help="llama-3.1-8b-random, smollm2 or a folder")
    parser.add_argument("--prompts", type=int, default=192)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--worker-concurrency",
        type=int,
        default=1,
        help="shards a worker runs at once (its pool processes, EAGLE3_WORKER_CONCURRENCY): with more than one, a "
        "shard's last writes overlap the next shard's captures",
    )
    parser.add_argument(
        "--inference-concurrency", type=int, default=4, help="capture requests in flight per shard a worker runs"
    )
    parser.add_argument("--write-concurrency", type=int, default=8, help="sample writer threads per worker")
    parser.add_argument(
        "--shard-tokens",
        type=int,
        help="the job's shard size (default: two shards per worker pool process, as a GPU job is sized: seconds of "
        "the server's work each, where the API's default of 16,384 tokens is a fraction of a second of an 8B prefill)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="jobs and prefills, alternating")
    parser.add_argument("--sglang", action="store_true", help="SGLang with the capture plugin as the capture server")
    parser.add_argument("--sglang-python", default=sys.executable)
    parser.add_argument("--sglang-args", default="", help="more arguments for SGLang")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/stack_extract"))
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args()
    exit_on_sigterm()

    args.work_dir.mkdir(parents=True, exist_ok=True)
    sglang_args = shlex.split(args.sglang_args)
    if args.model == RANDOM_8B and args.sglang:
        # Random weights either way: SGLang draws them (--load-format dummy), and the folder holds no weight files.
        model_dir = random_llama_8b(args.work_dir / "models" / "llama-3.1-8b-shape", weights=False)
        config = json.loads((model_dir / "config.json").read_text())
        sglang_args += ["--load-format", "dummy"]
    else:
        model_dir, config = capture_model(args.model, args.work_dir / "models")
    # Decoded and tokenized again, a record comes out longer (1.65x with the random model's small tokenizer): the job
    # truncates each to --prompt-tokens, as the yardstick's sequences are.
    max_length = args.prompt_tokens
    dataset = write_dataset(
        args.work_dir / "prompts.jsonl",
        model_dir,
        prompts=args.prompts,
        prompt_tokens=args.prompt_tokens,
        vocab_size=config["vocab_size"],
    )
    sequences = job_sequences(dataset, model_dir, max_length)
    settings = gpu_stack_settings(
        Settings(storage_url=(args.work_dir / "storage").as_uri(), home=args.work_dir / "home"),
        model=model_dir,
        work_dir=args.work_dir,
        dataset=dataset,
        inference_concurrency=args.inference_concurrency,
        regenerate_concurrency=1,
        write_concurrency=args.write_concurrency,
    ).model_copy(update={"worker_concurrency": args.worker_concurrency})
    inference_argv = None
    if args.sglang:
        inference_argv = [args.sglang_python, "-m", "eagle3_sglang_plugin.launch", *sglang_args]
    tokens = sum(len(s) for s in sequences)
    shards_at_once = args.workers * args.worker_concurrency
    shard_tokens = args.shard_tokens or math.ceil(tokens / (2 * shards_at_once))
    spec = {
        "dataset_url": str(dataset),
        "model_path": str(model_dir),
        "max_length": max_length,
        "shard_token_budget": shard_tokens,
    }
    concurrency = shards_at_once * args.inference_concurrency
    report: dict[str, Any] = {
        "model": args.model,
        "server": "sglang" if args.sglang else "reference",
        "prompts": len(sequences),
        "tokens": tokens,
        "shard_tokens": shard_tokens,
        "workers": args.workers,
        "worker_concurrency": args.worker_concurrency,
        "inference_concurrency": args.inference_concurrency,
        "prefill_concurrency": concurrency,
        "repeats": [],
    }
    with LocalStack(
        settings,
        workers=args.workers,
        log_dir=args.work_dir / "logs",
        pick_free_ports=True,
        inference_argv=inference_argv,
        inference_ready_timeout_s=SGLANG_START_TIMEOUT_S,
    ) as stack:
        url = stack.env["EAGLE3_INFERENCE_URL"]
        # Before anything is timed: the server's kernels warmed, and one small job through every worker.
        prefill(url, sequences[:concurrency], concurrency)
        warm = args.work_dir / "warm.jsonl"
        warm.write_text("".join(dataset.read_text().splitlines(keepends=True)[:concurrency]))
        with stack.api_client() as api:
            storage = open_storage(settings.storage_url, settings)
            run_job(api, {**spec, "dataset_url": str(warm)}, storage)
            for repeat in range(args.repeats):
                job = run_job(api, spec, storage)
                engine = prefill(url, sequences, concurrency)
                report["repeats"].append({"job": job, "prefill": engine})
                console.print(
                    f"repeat {repeat + 1}: job {job['tokens_per_second']:,.0f} tokens/s ({job['tokens']:,} tokens, "
                    f"{job['shards']} shards), prefill {engine['tokens_per_second']:,.0f} tokens/s"
                )
                console.print(describe_timeline(job["timeline"]))
    report["job_tokens_per_second"] = statistics.median(r["job"]["tokens_per_second"] for r in report["repeats"])
    report["prefill_tokens_per_second"] = statistics.median(
        r["prefill"]["tokens_per_second"] for r in report["repeats"]
    )
    report["ratio"] = report["job_tokens_per_second"] / report["prefill_tokens_per_second"]
    print_table(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
