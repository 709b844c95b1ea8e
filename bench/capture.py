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
from functools import partial
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from bench.common import bench_job, in_processes, reference_server
from shared.capture_protocol import default_aux_layer_ids
from shared.inference_client import InferenceClient
from shared.kinds.extract import capture_and_write
from shared.model_assets import resolve_model_path
from shared.schemas import JobRecord, SampleInput
from shared.storage import FileStorage

LLAMA_31_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
               "rope_theta": 500000.0, "rms_norm_eps": 1e-5}  # fmt: skip


def random_llama_8b(out_dir: Path) -> Path:
    """A Llama-3.1-8B-shaped model with random bf16 weights (no hub here), saved once as a Hugging Face folder."""
    if (out_dir / "config.json").exists():
        return out_dir
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.builders import build_tiny_llama

    build_tiny_llama(out_dir)  # the tokenizer; its model files are replaced below
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_31_8B, torch_dtype="bfloat16")).to(torch.bfloat16)
    model.save_pretrained(out_dir)
    return out_dir


def capture_model(name: str, work: Path) -> tuple[Path, dict[str, Any]]:
    """The model a capture benchmark runs ("llama-3.1-8b-random", "smollm2" or a local folder) and its config."""
    model_dir = random_llama_8b(work / name) if name == "llama-3.1-8b-random" else resolve_model_path(name)
    return model_dir, json.loads((model_dir / "config.json").read_text())


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


def _write_share(
    url: str,
    storage: FileStorage,
    job: JobRecord,
    samples: list[SampleInput],
    args: argparse.Namespace,
    shm_dir: Path,
    processes: int,
    p: int,
) -> None:
    """One worker process's share: its own client, the in-flight requests split between the processes."""
    with InferenceClient(
        url,
        timeout_s=900,
        max_concurrency=max(1, args.concurrency // processes),
        transport=args.transport,
        shm_dir=shm_dir,
    ) as client:
        capture_and_write(storage, job, p, samples[p::processes], client, write_concurrency=args.write_concurrency)


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
    parser.add_argument("--out-dir", type=Path, default=None, help="where sample files go (default: under --work)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)

    model_dir, config = capture_model(args.model, args.work)
    layers, hidden, vocab = config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
    aux = default_aux_layer_ids(layers)
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(100, min(vocab, 30000), (args.prompt_tokens,), generator=generator).tolist()
        for _ in range(args.prompts)
    ]
    samples = [
        SampleInput(sample_index=i, sample_id=f"p{i}", line=i + 1, input_ids=p, loss_mask=[1] * len(p))
        for i, p in enumerate(prompts)
    ]
    job = bench_job(hidden_size=hidden, num_hidden_layers=layers, vocab_size=vocab, aux_layer_ids=aux)
    tokens = sum(map(len, prompts))

    bare = bare_prefill_rate(model_dir, prompts, args.batch_tokens, args.repeats)
    shm_dir = args.work / "shm"
    out_root = args.out_dir or args.work / "out"
    direct_s, e2e_s = [], []
    with (
        reference_server(model_dir, shm_dir=shm_dir, log=args.work / "server.log") as url,
        InferenceClient(
            url, timeout_s=900, max_concurrency=args.concurrency, transport=args.transport, shm_dir=shm_dir
        ) as client,
    ):
        requests = [(f"warm/{i}", p) for i, p in enumerate(prompts[: args.concurrency])]
        list(client.capture_many(requests, aux))
        for r in range(args.repeats):
            started = time.perf_counter()
            for _ in client.capture_many([(f"direct/{r}/{i}", p) for i, p in enumerate(prompts)], aux):
                pass
            direct_s.append(time.perf_counter() - started)
            storage = FileStorage(str(out_root / f"run-{r}"), fsync=False)
            P = args.worker_processes
            e2e_s.append(in_processes(P, partial(_write_share, url, storage, job, samples, args, shm_dir, P)))
            shutil.rmtree(out_root / f"run-{r}")

    direct, e2e = tokens / statistics.median(direct_s), tokens / statistics.median(e2e_s)
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
        args.json.write_text(
            json.dumps(
                {
                    "model": args.model,
                    "device": device,
                    "prompts": args.prompts,
                    "prompt_tokens": args.prompt_tokens,
                    "concurrency": args.concurrency,
                    "transport": args.transport,
                    "worker_processes": args.worker_processes,
                    "bare_prefill_tokens_s": bare,
                    "server_direct_tokens_s": direct,
                    "end_to_end_tokens_s": e2e,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
