"""Worker data path: GB/s from received capture bytes to committed local storage (decode, validate,
encode, sha256, create-only write), with the worker's writer pool, against torch.save of the same
tensors to the same directory in the same process. Target: >= 3 GB/s per worker.

    python -m bench.data_path [--tokens 2048] [--hidden 4096] [--samples 16] [--threads 4] [--dir DIR] [--json OUT]
"""

import argparse
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from bench.common import bench_job, in_processes
from shared.capture.protocol import CapturedStates, decode_capture_body, encode_capture_body
from shared.lifecycle.kinds.extract import commit_sample
from shared.lifecycle.schemas import JobRecord, SampleInput
from shared.storage.objects import open_storage
from shared.storage.sample_format import encode_sample, validate_capture, write_sample


def run_pipeline(bodies: list[bytes], samples: list[SampleInput], job: JobRecord, root: Path, threads: int) -> float:
    storage = open_storage(root.as_uri())
    started = time.perf_counter()

    def one(i: int) -> None:
        (states,) = decode_capture_body(bytearray(bodies[i]))  # bytearray: what the client receives
        commit_sample(storage, job, 0, samples[i], states)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(len(bodies))))
    return time.perf_counter() - started


def _torch_share(states: list[CapturedStates], processes: int, root: Path, p: int) -> None:
    run_torch_save(states[p::processes], root / str(p))


def _pipeline_share(
    bodies: list[bytes], samples: list[SampleInput], job: JobRecord, root: Path, threads: int, processes: int, p: int
) -> None:
    run_pipeline(bodies[p::processes], samples[p::processes], job, root, threads)


def run_torch_save(states: list[CapturedStates], root: Path) -> float:
    root.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    for i, s in enumerate(states):
        torch.save({"aux_hidden_state": s.aux_hidden_state, "hidden_state": s.hidden_state}, root / f"{i}.pt")
    return time.perf_counter() - started


def stage_breakdown(body: bytes, sample: SampleInput, hidden: int, root: Path, repeats: int) -> dict[str, float]:
    """Median milliseconds of each step of commit_sample for one sample, single-threaded: where the time goes."""
    storage = open_storage(root.as_uri())
    times: dict[str, list[float]] = {}

    @contextmanager
    def timed(name: str) -> Iterator[None]:
        started = time.perf_counter()
        yield
        times.setdefault(name, []).append(1e3 * (time.perf_counter() - started))

    for r in range(repeats):
        with timed("receive (copy into a buffer)"):
            received = bytearray(body)
        with timed("decode capture body"):
            (states,) = decode_capture_body(received)
        with timed(f"validate ({torch.get_num_threads()} torch threads)"):
            validate_capture(
                states.aux_hidden_state, states.hidden_state, num_tokens=len(sample.input_ids), hidden_size=hidden
            )
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # what one of many writer threads can count on when every core is busy
        with timed("validate (1 torch thread)"):
            validate_capture(
                states.aux_hidden_state, states.hidden_state, num_tokens=len(sample.input_ids), hidden_size=hidden
            )
        torch.set_num_threads(threads)
        with timed("encode (torch.save to bytes)"):
            data = encode_sample(sample.input_ids, sample.loss_mask, states.aux_hidden_state, states.hidden_state)
        with timed("sha256"):
            hashlib.sha256(data).hexdigest()
        with timed("write (create-only)"):
            storage.put_if_absent(f"stages/{r}.pt", data)
        with timed("the three above streamed: torch.save into the file, hashed on the way (commit_sample)"):
            aux_state, hidden_state = states.aux_hidden_state, states.hidden_state
            storage.put_if_absent_from(
                f"stages/streamed-{r}.pt",
                lambda out, a=aux_state, h=hidden_state: write_sample(out, sample.input_ids, sample.loss_mask, a, h),
            )
        # For comparison only: the zip checksums torch.save computes (sample files keep them).
        torch.serialization.set_crc32_options(False)
        with timed("the same streamed without torch.save's crc32 (comparison, not what the worker writes)"):
            storage.put_if_absent_from(
                f"stages/no-crc-{r}.pt",
                lambda out, a=aux_state, h=hidden_state: write_sample(out, sample.input_ids, sample.loss_mask, a, h),
            )
        torch.serialization.set_crc32_options(True)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--processes", type=int, default=1, help="shards in flight: the worker's Celery concurrency")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where files are written (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    torch.manual_seed(0)
    L, H = args.tokens, args.hidden
    states = [
        CapturedStates(torch.randn(L, 3 * H).bfloat16(), torch.randn(L, H).bfloat16()) for _ in range(args.samples)
    ]
    bodies = [bytes(encode_capture_body([s])) for s in states]
    samples = [
        SampleInput(sample_index=i, sample_id=f"s{i}", line=i + 1, input_ids=list(range(L)), loss_mask=[1] * L)
        for i in range(args.samples)
    ]
    job = bench_job(hidden_size=H, num_hidden_layers=32, vocab_size=128256, aux_layer_ids=[1, 15, 28])
    nbytes = sum(s.aux_hidden_state.nbytes + s.hidden_state.nbytes for s in states)
    base = Path(tempfile.mkdtemp(prefix="eagle3-datapath-", dir=args.dir))
    pipeline_s, torch_s = [], []
    P = args.processes
    try:
        for r in range(args.repeats):
            torch_s.append(in_processes(P, partial(_torch_share, states, P, base / f"torch-{r}")))
            pipeline_s.append(
                in_processes(P, partial(_pipeline_share, bodies, samples, job, base / f"pipeline-{r}", args.threads, P))
            )
            shutil.rmtree(base / f"torch-{r}")
            shutil.rmtree(base / f"pipeline-{r}")
    finally:
        shutil.rmtree(base, ignore_errors=True)

    pipeline_gbs = nbytes / statistics.median(pipeline_s) / 1e9
    torch_gbs = nbytes / statistics.median(torch_s) / 1e9
    table = Table(
        title=f"{args.samples} samples x {L} tokens, hidden {H} ({nbytes / 1e9:.2f} GB of bf16 states), "
        f"{os.cpu_count()} cores, median of {args.repeats}"
    )
    for column in ("path", "GB/s", "ratio to torch.save", "target"):
        table.add_column(column)
    table.add_row(f"torch.save to file, {args.processes} processes (baseline)", f"{torch_gbs:.2f}", "1.00", "")
    table.add_row(
        f"worker data path, {args.processes} processes x {args.threads} writer threads",
        f"{pipeline_gbs:.2f}",
        f"{pipeline_gbs / torch_gbs:.2f}",
        ">= 3 GB/s",
    )
    Console().print(table)
    stages = stage_breakdown(bodies[0], samples[0], H, base, args.repeats + 2)
    breakdown = Table(title=f"one sample ({bodies[0].__len__() / 1e6:.0f} MB), single thread: median ms per step")
    breakdown.add_column("step")
    breakdown.add_column("ms")
    for name, ms in stages.items():
        breakdown.add_row(name, f"{ms:.1f}")
    Console().print(breakdown)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "pipeline_gb_s": pipeline_gbs,
                    "torch_save_gb_s": torch_gbs,
                    "threads": args.threads,
                    "processes": args.processes,
                    "stages_ms": stages,
                    "tokens": L,
                    "hidden": H,
                    "samples": args.samples,
                    "cpus": os.cpu_count(),
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
