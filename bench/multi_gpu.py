"""Multi-GPU scaling, measured against one GPU in the same command.

- trainer: `eagle3 train` under torchrun on N processes (NCCL on GPUs, gloo on CPU) against one process taking the
  same global batch as N micro-batches (--grad-accum N), on a synthetic job of random hidden states at a model's
  dimensions. Reports tokens/s of both, the scaling efficiency (N-process tokens/s over N x one-process tokens/s)
  and the largest relative difference between the two loss curves (identical data, identical global batches).
- capture: N reference-backend servers, one per GPU, and 2N worker processes pulling shards from one shared queue
  (each worker drives the server of its GPU through the real capture, validation and write path), against the same
  with one server and two workers. Target: N=2 >= 1.9x one GPU.

    python -m bench.multi_gpu trainer --gpus 2 --shape llama3-8b --out DIR             # GPU host, NCCL
    python -m bench.multi_gpu capture --gpus 2 --model llama-3.1-8b-random --out DIR   # GPU host
    python -m bench.multi_gpu trainer --gpus 2 --shape small --device cpu --out DIR    # the same path on CPUs

The trainer's synthetic target folder holds only what the trainer reads from a target (config.json, the
embedding, lm_head and final norm), so an 8B-shaped run writes 2 GB of weights, not 16.
"""

import argparse
import io
import json
import multiprocessing
import os
import queue
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from safetensors.torch import save_file

from bench.capture_model import capture_model
from bench.common import bench_job, in_processes, reference_server
from shared.capture.client import InferenceClient
from shared.capture.protocol import default_aux_layer_ids
from shared.data.vocab import build_vocab_mapping, vocab_mapping_bytes
from shared.lifecycle.kinds.extract import capture_and_write, describe_sample
from shared.lifecycle.schemas import JobRecord, Manifest, SampleInput, utc_now
from shared.storage import layout
from shared.storage.objects import FileStorage
from shared.storage.sample_format import encode_sample

REPO_ROOT = Path(__file__).resolve().parents[1]

# Target dimensions for the trainer run: the drafter is one layer as wide as the target.
TRAINER_SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "draft_vocab_size": 32000,
        "rope_theta": 500000.0,
    },
    "small": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1024,
        "draft_vocab_size": 512,
        "rope_theta": 10000.0,
    },
}


# ---------------------------------------------------------------------------------------------------------------------
# trainer


def synthetic_target(out_dir: Path, shape: dict[str, Any]) -> Path:
    """A target folder with config.json and the three tensors the trainer reads, random bf16."""
    out_dir.mkdir(parents=True, exist_ok=True)
    hidden, vocab = shape["hidden_size"], shape["vocab_size"]
    config = {k: v for k, v in shape.items() if k != "draft_vocab_size"}
    config |= {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": (torch.randn(vocab, hidden, generator=generator) * 0.02).to(torch.bfloat16),
        "lm_head.weight": (torch.randn(vocab, hidden, generator=generator) * 0.02).to(torch.bfloat16),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
    }
    save_file(tensors, str(out_dir / "model.safetensors"))
    return out_dir


def synthetic_job(storage: FileStorage, target: Path, shape: dict[str, Any], *, samples: int, seq_len: int) -> str:
    """A committed job of random hidden states, laid out as the workers commit one: samples, then manifests."""
    job_id = "bench-multi-gpu"
    hidden, vocab, layers = shape["hidden_size"], shape["vocab_size"], shape["num_hidden_layers"]
    generator = torch.Generator().manual_seed(0)
    entries = []
    for index in range(samples):
        input_ids = torch.randint(0, shape["draft_vocab_size"], (seq_len,), generator=generator).tolist()
        sample = SampleInput(
            sample_index=index, sample_id=f"s{index}", line=index + 1, input_ids=input_ids, loss_mask=[1] * seq_len
        )
        aux = torch.randn(seq_len, 3 * hidden, generator=generator).to(torch.bfloat16)
        final = torch.randn(seq_len, hidden, generator=generator).to(torch.bfloat16)
        data = encode_sample(sample.input_ids, sample.loss_mask, aux, final)
        key = layout.sample(job_id, index)
        storage.put(key, data)
        entries.append(describe_sample(sample, key, data))
    base = bench_job(
        hidden_size=hidden, num_hidden_layers=layers, vocab_size=vocab, aux_layer_ids=default_aux_layer_ids(layers)
    )
    job = base.model_copy(
        update={
            "job_id": job_id,
            "model": base.model.model_copy(update={"path": str(target)}),
            "samples_total": samples,
            "tokens_total": samples * seq_len,
            "loss_tokens_total": samples * seq_len,
            "shards_total": samples,
            "draft_vocab_size": shape["draft_vocab_size"],
        }
    )
    counts = Counter({token: vocab - token for token in range(vocab)})  # any fixed ranking: the data is random
    mapping = build_vocab_mapping(counts, target_vocab_size=vocab, draft_vocab_size=shape["draft_vocab_size"])
    storage.put(layout.vocab_mapping(job_id), vocab_mapping_bytes(mapping))
    for entry in entries:  # one sample per shard: the data order is a pure function of the seed
        manifest = Manifest.of(job, entry.sample_index, [entry], worker="bench", committed_at=utc_now())
        storage.put(layout.manifest(job_id, entry.sample_index), manifest.model_dump_json().encode())
    storage.put(layout.job_json(job_id), job.model_dump_json(indent=2).encode())
    return job_id


def run_trainer(job_id: str, work: Path, *, processes: int, grad_accum: int, args: argparse.Namespace) -> dict:
    """`eagle3 train` under torchrun; the run's checkpoint (with its per-step history)."""
    run_name = f"procs{processes}"
    env = {
        **os.environ,
        "EAGLE3_STORAGE_URL": str(work / "storage"),
        "EAGLE3_HOME": str(work / "home"),
        "PYTHONPATH": str(REPO_ROOT),
    }
    if args.device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={processes}",
        "-m",
        "eagle3",
        "train",
        "--job",
        job_id,
        "--run-name",
        run_name,
        "--device",
        args.device,
        "--max-steps",
        str(args.steps),
        "--batch-tokens",
        str(args.batch_tokens),
        "--max-length",
        str(args.seq_len),
        "--grad-accum",
        str(grad_accum),
        "--epochs",
        "1000",
        "--log-every",
        "1",
        "--heldout-fraction",
        "0",
        "--checkpoint-every",
        str(10**6),
        "--lr",
        "1e-4",
    ]
    log = work / f"{run_name}.log"
    with log.open("w") as out:
        result = subprocess.run(command, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        raise SystemExit(f"trainer with {processes} processes failed; see {log}")
    storage = FileStorage(str(work / "storage"))
    latest = json.loads(storage.get(layout.trainer_latest(job_id, run_name)))
    return torch.load(io.BytesIO(storage.get(latest["key"])), weights_only=True)


def trainer(args: argparse.Namespace) -> dict[str, Any]:
    shape = TRAINER_SHAPES[args.shape]
    work = args.work / f"trainer-{args.shape}"
    storage = FileStorage(str(work / "storage"))
    target = synthetic_target(work / "target", shape)
    samples = args.steps * args.gpus * max(1, args.batch_tokens // args.seq_len)
    job_id = synthetic_job(storage, target, shape, samples=samples, seq_len=args.seq_len)

    one = run_trainer(job_id, work, processes=1, grad_accum=args.gpus, args=args)
    many = run_trainer(job_id, work, processes=args.gpus, grad_accum=1, args=args)
    warm = min(args.warmup, args.steps - 1)

    def rate(checkpoint: dict) -> float:
        return statistics.median(h["tokens_per_second"] for h in checkpoint["history"][warm:])

    losses_one = [h["loss"] for h in one["history"]]
    losses_many = [h["loss"] for h in many["history"]]
    loss_gap = max(abs(a - b) / abs(b) for a, b in zip(losses_many, losses_one, strict=True))
    result = {
        "shape": args.shape,
        "device": device_name(args.device),
        "gpus": args.gpus,
        "global_batch_tokens": args.batch_tokens * args.gpus,
        "steps": args.steps,
        "one_process_tokens_per_second": rate(one),
        "n_process_tokens_per_second": rate(many),
        "scaling_efficiency": rate(many) / (args.gpus * rate(one)),
        "max_relative_loss_difference": loss_gap,
        "losses_one_process": losses_one,
        "losses_n_processes": losses_many,
    }
    table = Table(
        title=f"trainer, {args.shape} dims, TTT 7, global batch {args.gpus} x {args.batch_tokens} tokens "
        f"on {result['device']}, median over steps {warm + 1}..{args.steps}"
    )
    for column in ("run", "tokens/s", "vs one process"):
        table.add_column(column)
    table.add_row(f"1 process, grad accum {args.gpus}", f"{rate(one):.0f}", "1.00")
    table.add_row(f"{args.gpus} processes (DDP)", f"{rate(many):.0f}", f"{rate(many) / rate(one):.2f}")
    Console().print(table)
    Console().print(
        f"scaling efficiency {result['scaling_efficiency']:.2f}; loss curves differ by at most "
        f"{loss_gap:.2e} (relative)"
    )
    return result


# ---------------------------------------------------------------------------------------------------------------------
# capture


def _capture_worker(
    urls: list[str], shards: "multiprocessing.Queue[list[SampleInput]]", job: JobRecord, out: Path, shm: Path, p: int
) -> None:
    """One worker process: the server of its GPU, shards from the shared queue until it is empty."""
    storage = FileStorage(str(out), fsync=False)
    with InferenceClient(urls[p % len(urls)], timeout_s=900, max_concurrency=4, transport="shm", shm_dir=shm) as client:
        while True:
            try:
                samples = shards.get(timeout=1)
            except queue.Empty:
                return
            capture_and_write(storage, job, samples[0].sample_index, samples, client, write_concurrency=4)


def capture_rate(
    model_dir: Path, gpus: int, samples: list[SampleInput], job: JobRecord, args: argparse.Namespace
) -> float:
    """End-to-end tokens/s of `gpus` servers (one per GPU) and two worker processes per server."""
    work = args.work / f"capture-{gpus}"
    shm = work / "shm"
    shm.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        urls = [
            stack.enter_context(
                reference_server(
                    model_dir,
                    shm_dir=shm,
                    log=work / f"server-{g}.log",
                    env={"CUDA_VISIBLE_DEVICES": str(g)} if args.device != "cpu" else {},
                    device=args.device,
                )
            )
            for g in range(gpus)
        ]
        for url in urls:  # the first forward of a server pays for kernel selection and allocation
            with InferenceClient(url, timeout_s=900, transport="shm", shm_dir=shm) as client:
                warm = [(f"warm/{i}", s.input_ids) for i, s in enumerate(samples[:2])]
                list(client.capture_many(warm, job.aux_layer_ids))
        shards: multiprocessing.Queue[list[SampleInput]] = multiprocessing.get_context("fork").Queue()
        per_shard = args.samples_per_shard
        for start in range(0, len(samples), per_shard):
            shards.put(samples[start : start + per_shard])
        seconds = in_processes(2 * gpus, partial(_capture_worker, urls, shards, job, work / "out", shm))
    return sum(len(s.input_ids) for s in samples) / seconds


def capture(args: argparse.Namespace) -> dict[str, Any]:
    model_dir, config = capture_model(args.model, args.work)
    layers, hidden, vocab = config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
    job = bench_job(
        hidden_size=hidden, num_hidden_layers=layers, vocab_size=vocab, aux_layer_ids=default_aux_layer_ids(layers)
    )
    generator = torch.Generator().manual_seed(0)
    samples = [
        SampleInput(
            sample_index=i,
            sample_id=f"p{i}",
            line=i + 1,
            loss_mask=[1] * args.prompt_tokens,
            input_ids=torch.randint(100, min(vocab, 30000), (args.prompt_tokens,), generator=generator).tolist(),
        )
        for i in range(args.prompts)
    ]
    one = capture_rate(model_dir, 1, samples, job, args)
    many = capture_rate(model_dir, args.gpus, samples, job, args)
    result = {
        "model": args.model,
        "device": device_name(args.device),
        "gpus": args.gpus,
        "prompts": args.prompts,
        "prompt_tokens": args.prompt_tokens,
        "one_gpu_tokens_per_second": one,
        "n_gpu_tokens_per_second": many,
        "speedup": many / one,
    }
    table = Table(
        title=f"capture end to end, {args.model}, {args.prompts} x {args.prompt_tokens} tokens, "
        f"2 workers per server, shm transport, on {result['device']}"
    )
    for column in ("servers", "tokens/s", "vs one"):
        table.add_column(column)
    table.add_row("1", f"{one:.0f}", "1.00")
    table.add_row(str(args.gpus), f"{many:.0f}", f"{many / one:.2f}")
    Console().print(table)
    return result


def device_name(device: str) -> str:
    if device != "cpu" and torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
    return "CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["trainer", "capture"])
    parser.add_argument("--gpus", type=int, default=2, help="processes / servers of the scaled run")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "eagle3-multi-gpu")
    parser.add_argument("--out", type=Path, help="write the result as JSON into this folder")
    trainer_group = parser.add_argument_group("trainer")
    trainer_group.add_argument("--shape", choices=sorted(TRAINER_SHAPES), default="llama3-8b")
    trainer_group.add_argument("--steps", type=int, default=20)
    trainer_group.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    trainer_group.add_argument("--seq-len", type=int, default=2048)
    trainer_group.add_argument("--batch-tokens", type=int, default=8192, help="per process and micro-batch")
    capture_group = parser.add_argument_group("capture")
    capture_group.add_argument("--model", default="llama-3.1-8b-random", help="llama-3.1-8b-random, smollm2, a folder")
    capture_group.add_argument("--prompts", type=int, default=96)
    capture_group.add_argument("--prompt-tokens", type=int, default=2048)
    capture_group.add_argument("--samples-per-shard", type=int, default=4)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    result = trainer(args) if args.what == "trainer" else capture(args)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"multi_gpu_{args.what}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
