"""Capture throughput of the reference backend: bare prefill (the model's forward, in this process) against the
server driven directly over HTTP, and against the full worker data path (capture over HTTP, validation, sample
files written by the writer pool). Same model, same prompts, alternating runs; medians and ratios.

Targets (docs/benchmarks.md) on an H100 with the Llama-3.1-8B shape: end to end >= 0.95 x bare prefill, and the
reference backend >= 38K tokens/s.

    python -m bench.capture --model smollm2 --prompts 32 --prompt-tokens 256          # CPU, this machine
    python -m bench.capture --model llama-3.1-8b-random --prompts 64 --prompt-tokens 2048 --json OUT   # GPU host
"""

import argparse
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from bench.capture_model import bench_prompts, capture_model
from bench.common import bench_job, in_processes, reference_server
from shared.capture.client import InferenceClient
from shared.capture.protocol import default_aux_layer_ids
from shared.lifecycle.kinds.extract import capture_and_write
from shared.lifecycle.schemas import JobRecord, SampleInput
from shared.storage.objects import FileStorage


def bare_prefill_rate(model_dir: Path, prompts: list[list[int]], batch_tokens: int, repeats: int) -> float:
    """Tokens/s of the model's forward alone, batched as the server batches (up to batch_tokens per pass)."""
    from services.inference.reference.engine import compute_dtype

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=compute_dtype("auto", device)).to(device).eval()
    per_batch = max(1, batch_tokens // len(prompts[0]))
    batches = [torch.tensor(prompts[i : i + per_batch], device=device) for i in range(0, len(prompts), per_batch)]
    times = []
    with torch.inference_mode():
        model.model(batches[0])  # warm-up
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            for batch in batches:
                model.model(batch)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return sum(map(len, prompts)) / statistics.median(times)


@dataclass(frozen=True)
class Workload:
    """The prompts of one capture benchmark, as bare prompts and as a job's samples."""

    prompts: list[list[int]]
    samples: list[SampleInput]
    job: JobRecord

    @property
    def tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def aux_layer_ids(self) -> list[int]:
        return self.job.aux_layer_ids

    def head(self, count: int) -> "Workload":
        """The first `count` prompts, same job."""
        return Workload(self.prompts[:count], self.samples[:count], self.job)


def workload(config: dict[str, Any], prompts: int, prompt_tokens: int) -> Workload:
    layers, hidden, vocab = config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
    bare = bench_prompts(prompts, prompt_tokens, vocab)
    samples = [
        SampleInput(sample_index=i, sample_id=f"p{i}", line=i + 1, input_ids=p, loss_mask=[1] * len(p))
        for i, p in enumerate(bare)
    ]
    job = bench_job(
        hidden_size=hidden, num_hidden_layers=layers, vocab_size=vocab, aux_layer_ids=default_aux_layer_ids(layers)
    )
    return Workload(bare, samples, job)


@dataclass(frozen=True)
class CaptureRun:
    """How the worker side drives a server: requests in flight, transport, worker processes, writer threads."""

    concurrency: int
    transport: str
    shm_dir: Path | None
    worker_processes: int = 1
    write_concurrency: int = 4
    torch_threads: int | None = None  # torch's intra-op threads per worker process; None: torch's default


def capture_direct_seconds(url: str, work: Workload, run: CaptureRun, label: str) -> float:
    """Seconds to capture every prompt with the project's client, `run.concurrency` in flight; tensors dropped."""
    with InferenceClient(
        url, timeout_s=900, max_concurrency=run.concurrency, transport=run.transport, shm_dir=run.shm_dir
    ) as client:
        started = time.perf_counter()
        for _ in client.capture_many([(f"{label}/{i}", p) for i, p in enumerate(work.prompts)], work.aux_layer_ids):
            pass
        return time.perf_counter() - started


def end_to_end_seconds(url: str, work: Workload, run: CaptureRun, out_dir: Path) -> float:
    """Seconds for the worker's path (capture, validate, encode, hash, write each sample file create-only) in
    `run.worker_processes` processes at once; the files are removed afterwards."""
    storage = FileStorage(str(out_dir), fsync=False)
    P = run.worker_processes
    try:
        return in_processes(P, partial(_write_share, url, storage, work, run, P))
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def _write_share(url: str, storage: FileStorage, work: Workload, run: CaptureRun, processes: int, p: int) -> None:
    """One worker process's share: its own client, the in-flight requests split between the processes."""
    if run.torch_threads is not None:
        torch.set_num_threads(run.torch_threads)
    with InferenceClient(
        url,
        timeout_s=900,
        max_concurrency=max(1, run.concurrency // processes),
        transport=run.transport,
        shm_dir=run.shm_dir,
    ) as client:
        capture_and_write(
            storage, work.job, p, work.samples[p::processes], client, write_concurrency=run.write_concurrency
        )


def reference_rates(
    model_dir: Path, work: Workload, run: CaptureRun, *, batch_tokens: int, repeats: int, scratch: Path
) -> dict[str, float]:
    """Tokens/s of the reference backend: bare prefill in this process, its server driven directly, end to end."""
    bare = bare_prefill_rate(model_dir, work.prompts, batch_tokens, repeats)
    shm_dir = scratch / "shm"
    run = replace(run, shm_dir=shm_dir)
    direct_s, e2e_s = [], []
    env = {"EAGLE3_INFERENCE_MAX_BATCH_TOKENS": str(batch_tokens)}
    with reference_server(model_dir, shm_dir=shm_dir, log=scratch / "server.log", env=env) as url:
        capture_direct_seconds(url, replace(work, prompts=work.prompts[: run.concurrency]), run, "warm")
        for r in range(repeats):
            direct_s.append(capture_direct_seconds(url, work, run, f"direct/{r}"))
            e2e_s.append(end_to_end_seconds(url, work, run, scratch / "out" / f"run-{r}"))
    return {
        "bare_prefill_tokens_s": bare,
        "server_direct_tokens_s": work.tokens / statistics.median(direct_s),
        "end_to_end_tokens_s": work.tokens / statistics.median(e2e_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2, llama-3.1-8b-random, or a local HF folder")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=8, help="capture requests in flight")
    parser.add_argument("--write-concurrency", type=int, default=4)
    parser.add_argument("--worker-processes", type=int, default=1, help="shards in flight (Celery concurrency)")
    parser.add_argument("--transport", choices=["body", "shm"], default="body")
    parser.add_argument("--batch-tokens", type=int, default=8192, help="the server's EAGLE3_INFERENCE_MAX_BATCH_TOKENS")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "eagle3-bench")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)

    model_dir, config = capture_model(args.model, args.work)
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    work = workload(config, args.prompts, args.prompt_tokens)
    run = CaptureRun(args.concurrency, args.transport, None, args.worker_processes, args.write_concurrency)
    rates = reference_rates(
        model_dir, work, run, batch_tokens=args.batch_tokens, repeats=args.repeats, scratch=args.work
    )
    bare, direct, e2e = rates["bare_prefill_tokens_s"], rates["server_direct_tokens_s"], rates["end_to_end_tokens_s"]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    table = Table(
        title=f"{args.model} ({layers} layers, hidden {hidden}) on {device}: {args.prompts} prompts x "
        f"{args.prompt_tokens} tokens, {args.concurrency} in flight, {args.transport} transport, "
        f"{args.worker_processes} worker processes, "
        f"median of {args.repeats}"
    )
    for column in ("measure", "tokens/s", "ratio to bare prefill"):
        table.add_column(column)
    table.add_row("bare prefill (model forward, in process)", f"{bare:.0f}", "1.00")
    table.add_row("reference server driven directly (HTTP)", f"{direct:.0f}", f"{direct / bare:.2f}")
    table.add_row("end to end: capture, validate, write files", f"{e2e:.0f}", f"{e2e / bare:.2f}")
    Console().print(table)
    if args.json:
        summary = {
            "model": args.model,
            "device": device,
            "prompts": args.prompts,
            "prompt_tokens": args.prompt_tokens,
            "concurrency": args.concurrency,
            "transport": args.transport,
            "worker_processes": args.worker_processes,
            **rates,
        }
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
