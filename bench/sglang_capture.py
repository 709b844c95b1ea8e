"""Capture throughput on SGLang, against SGLang's own prefill and the reference backend, in one command.

Same prompts, same requests in flight, medians of alternating runs:
- SGLang's own prefill with capture off: a stock server (no plugin, no aux capture), plain `/generate` requests of
  the prompts with `max_new_tokens` 1, from `--concurrency` threads. Every ratio is to this row.
- the same plain requests on the capture server (what arming aux capture costs SGLang itself);
- the plugin's capture driven directly: the project's InferenceClient, tensors read and dropped, per transport;
- end to end: the worker's path (capture, validation, encoding, sha256, sample files written create-only) in
  `--worker-processes` processes sharing the requests in flight, per transport (a list: one row per count; each
  process keeps concurrency // count requests in flight, so counts that divide `--concurrency` keep its total);
- with `--reference`: the reference backend on the same model and GPU (bench/capture.py), after SGLang stopped.

Either the servers run already (`--url` is the capture server, `--baseline-url` a stock one, `--shm-dir` the
capture server's shared directory as mounted here), or `--launch` starts each in turn from this Python, which must
have SGLang and the plugin installed (`--sglang-args` go to both launches, e.g. `--mem-fraction-static 0.8`):

    python -m bench.sglang_capture --launch --model llama-3.1-8b-random --prompts 48 --prompt-tokens 2048 \\
        --concurrency 8 --worker-processes 2,4,8 --reference --json capture.json
    python -m bench.sglang_capture --url http://gpu:30000 --baseline-url http://gpu:30001 \\
        --shm-dir /dev/shm/eagle3 --model /models/target
"""

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import torch
from rich.console import Console
from rich.table import Table

from bench.capture import (
    CaptureRun,
    Workload,
    capture_direct_seconds,
    end_to_end_seconds,
    reference_rates,
    workload,
)
from bench.capture_model import capture_model
from eagle3.local_stack import free_port
from shared.inference_client import InferenceClient

# What the plugin's launcher also passes (eagle3_sglang_plugin.launch), so that the stock server runs the same
# prefills: token ids in and out, whole prompts in one forward, no prefix cache.
STOCK_FLAGS = ["--skip-tokenizer-init", "--chunked-prefill-size", "-1", "--disable-radix-cache"]
START_TIMEOUT_S = 900.0


@contextmanager
def sglang_server(
    kind: str, model_dir: Path, *, shm_dir: Path, extra_args: list[str], log: Path, env: dict[str, str] | None = None
) -> Iterator[str]:
    """A SGLang server of this Python as its own process group: "stock" (plugin off, no aux capture) or "capture"
    (the plugin's launcher). Yields its URL once `/health` answers 200; stops every process of it afterwards."""
    port = free_port()
    environ = {**os.environ, **(env or {})}
    if kind == "stock":
        environ["SGLANG_PLUGINS"] = "none"
        argv = ["-m", "sglang.launch_server", "--model-path", str(model_dir), "--host", "127.0.0.1"]
        argv += ["--port", str(port), *STOCK_FLAGS, *extra_args]
    else:
        environ.update(
            EAGLE3_MODEL_PATH=str(model_dir),
            EAGLE3_INFERENCE_HOST="127.0.0.1",
            EAGLE3_INFERENCE_PORT=str(port),
            EAGLE3_SHM_DIR=str(shm_dir),
        )
        argv = ["-m", "eagle3_sglang_plugin.launch", *extra_args]
    with log.open("ab") as out:
        server = subprocess.Popen(
            [sys.executable, *argv], env=environ, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, server, log)
        yield url
    finally:
        stop_process_group(server)


def wait_healthy(url: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"SGLang exited with {server.returncode} before it was healthy; see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"SGLang not healthy after {START_TIMEOUT_S:.0f} s; see {log}")
        time.sleep(2)


def stop_process_group(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (SGLang's scheduler and detokenizer are its children), then SIGKILL
    to whatever of the group is left (the group id stays the leader's pid)."""
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with suppress(subprocess.TimeoutExpired):
        process.wait(timeout=60)
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


def plain_prefill_seconds(url: str, work: Workload, concurrency: int) -> float:
    """Seconds for plain `/generate` requests of every prompt (`max_new_tokens` 1: the prefill and the token it
    samples), `concurrency` in flight: the server's own prefill rate as a client sees it."""
    params = {"max_new_tokens": 1, "temperature": 0}
    with InferenceClient(url, timeout_s=900, max_concurrency=concurrency) as client:

        def one(prompt: list[int]) -> None:
            answer = client.generate(input_ids=prompt, sampling_params=params)
            assert isinstance(answer, dict) and answer["meta_info"]["prompt_tokens"] == len(prompt), answer

        started = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, work.prompts))
        return time.perf_counter() - started


Measure = tuple[str, Callable[[int], float]]  # (row label, seconds of run r)


def cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) CPU time of the whole machine since boot, all cores, from /proc/stat; None without it."""
    try:
        first_line = Path("/proc/stat").read_text().split("\n", 1)[0]
    except OSError:
        return None
    fields = [int(value) for value in first_line.split()[1:]]
    idle = fields[3] + fields[4]  # idle and iowait
    return sum(fields) - idle, sum(fields)


def medians(measures: list[Measure], repeats: int, tokens: int, console: Console) -> dict[str, dict[str, Any]]:
    """Alternating runs of every measure; tokens/s of the median run, the runs' seconds, and how busy the
    machine's CPUs were during each run (SGLang, client and worker processes together)."""
    seconds: dict[str, list[float]] = {label: [] for label, _ in measures}
    cpu_busy: dict[str, list[float]] = {label: [] for label, _ in measures}
    for r in range(repeats):
        for label, run in measures:
            before = cpu_jiffies()
            seconds[label].append(run(r))
            after = cpu_jiffies()
            if before and after and after[1] > before[1]:
                cpu_busy[label].append((after[0] - before[0]) / (after[1] - before[1]))
            console.log(f"run {r + 1}/{repeats} {label}: {tokens / seconds[label][-1]:.0f} tokens/s")
    return {
        label: {
            "tokens_s": tokens / statistics.median(runs),
            "seconds": [round(s, 3) for s in runs],
            "cpu_busy": round(statistics.median(cpu_busy[label]), 3) if cpu_busy[label] else None,
        }
        for label, runs in seconds.items()
    }


def stock_measures(url: str, work: Workload, concurrencies: list[int]) -> list[Measure]:
    return [(f"SGLang prefill, capture off (stock server) @{c}", _plain(url, work, c)) for c in concurrencies]


def capture_measures(
    url: str, work: Workload, args: argparse.Namespace, shm_dir: Path | None, scratch: Path
) -> list[Measure]:
    transports = [t for t in args.transports if t == "body" or shm_dir is not None]
    measures: list[Measure] = []
    for c in args.concurrency:
        measures.append((f"plain requests on the capture server @{c}", _plain(url, work, c)))
        for transport in transports:
            run = CaptureRun(c, transport, shm_dir, 1, args.write_concurrency)
            measures.append((f"capture driven directly, {transport} @{c}", _direct(url, work, run)))
            for processes in args.worker_processes:
                run = replace(run, worker_processes=processes)
                label = f"end to end, {transport}, {processes} worker processes @{c}"
                measures.append((label, _end_to_end(url, work, run, scratch)))
            if args.single_thread_workers:
                # The most processes once more, each with one torch thread: many writer threads' intra-op thread
                # pools compete for the cores that SGLang's scheduler also needs.
                run = replace(run, worker_processes=max(args.worker_processes), torch_threads=1)
                label = f"end to end, {transport}, {run.worker_processes} worker processes, 1 torch thread each @{c}"
                measures.append((label, _end_to_end(url, work, run, scratch)))
    return measures


def _plain(url: str, work: Workload, concurrency: int) -> Callable[[int], float]:
    return lambda r: plain_prefill_seconds(url, work, concurrency)


def _direct(url: str, work: Workload, run: CaptureRun) -> Callable[[int], float]:
    return lambda r: capture_direct_seconds(url, work, run, f"direct-{run.transport}-{run.concurrency}/{r}")


def _end_to_end(url: str, work: Workload, run: CaptureRun, scratch: Path) -> Callable[[int], float]:
    return lambda r: end_to_end_seconds(url, work, run, scratch / "out" / f"{run.transport}-{run.concurrency}-{r}")


def warm_up(measures: list[Measure]) -> None:
    """One unmeasured run of each measure: kernels compiled, pinned and shared memory allocated."""
    for _, run in measures:
        run(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.1-8b-random", help="llama-3.1-8b-random, smollm2 or a folder")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[8],
                        help="requests in flight, e.g. 8 or 8,16; the first is the headline")  # fmt: skip
    parser.add_argument("--transports", type=lambda s: s.split(","), default=["shm", "body"])
    parser.add_argument(
        "--worker-processes",
        type=lambda s: [int(p) for p in s.split(",")],
        default=[2],
        help="worker processes sharing the in-flight requests (Celery concurrency), e.g. 2 or 2,4,8",
    )
    parser.add_argument("--write-concurrency", type=int, default=4, help="writer threads per worker process")
    parser.add_argument(
        "--single-thread-workers",
        action="store_true",
        help="one more end-to-end row: the most worker processes, each limited to one torch thread",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--launch", action="store_true", help="start a stock and a capture SGLang server here")
    parser.add_argument("--sglang-args", default="", help="extra sglang.launch_server arguments of both launches")
    parser.add_argument("--url", help="the capture server (without --launch)")
    parser.add_argument("--baseline-url", help="a stock SGLang server of the same model (without --launch)")
    parser.add_argument("--shm-dir", type=Path, help="the capture server's shared directory as mounted here")
    parser.add_argument("--reference", action="store_true", help="also the reference backend on this machine")
    parser.add_argument("--reference-batch-tokens", type=int, default=8192)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "eagle3-bench-sglang")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not args.launch and not args.url:
        parser.error("give --url (a running capture server) or --launch")
    # SIGTERM (a timeout, a job runner) as an exception, so that the servers this run launched are stopped too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    args.work.mkdir(parents=True, exist_ok=True)
    console = Console()

    model_dir, config = capture_model(args.model, args.work)
    work = workload(config, args.prompts, args.prompt_tokens)
    extra = shlex.split(args.sglang_args)
    results: dict[str, dict[str, Any]] = {}
    info: dict[str, Any] = {}

    def save() -> None:
        """The JSON summary so far: a long run that is cut short keeps the phases it finished."""
        if args.json:
            args.json.write_text(json.dumps(summary(args, info, extra, results), indent=2))

    if args.launch:
        shm_dir = args.work / "shm"
        log = args.work / "sglang-stock.log"
        with sglang_server("stock", model_dir, shm_dir=shm_dir, extra_args=extra, log=log) as url:
            measures = stock_measures(url, work, args.concurrency)
            warm_up(measures)
            results |= medians(measures, args.repeats, work.tokens, console)
        save()
        log = args.work / "sglang-capture.log"
        with sglang_server("capture", model_dir, shm_dir=shm_dir, extra_args=extra, log=log) as url:
            info = httpx.get(f"{url}/get_model_info", timeout=30).json()
            measures = capture_measures(url, work, args, shm_dir, args.work)
            warm_up(measures)
            results |= medians(measures, args.repeats, work.tokens, console)
        save()
    else:
        if args.baseline_url:
            measures = stock_measures(args.baseline_url, work, args.concurrency)
            warm_up(measures)
            results |= medians(measures, args.repeats, work.tokens, console)
        info = httpx.get(f"{args.url}/get_model_info", timeout=30).json()
        measures = capture_measures(args.url, work, args, args.shm_dir, args.work)
        warm_up(measures)
        results |= medians(measures, args.repeats, work.tokens, console)
        save()

    if args.reference:
        c = args.concurrency[0]
        run = CaptureRun(c, "shm", None, max(args.worker_processes), args.write_concurrency)
        scratch = args.work / "reference"
        scratch.mkdir(exist_ok=True)
        rates = reference_rates(
            model_dir, work, run, batch_tokens=args.reference_batch_tokens, repeats=args.repeats, scratch=scratch
        )
        results[f"reference: bare prefill (model forward, in process) @{c}"] = {
            "tokens_s": rates["bare_prefill_tokens_s"]
        }
        results[f"reference: server driven directly, shm @{c}"] = {"tokens_s": rates["server_direct_tokens_s"]}
        label = f"reference: end to end, shm, {run.worker_processes} worker processes @{c}"
        results[label] = {"tokens_s": rates["end_to_end_tokens_s"]}

    save()
    print_table(args, config, info, results, console)


def summary(
    args: argparse.Namespace, info: dict[str, Any], extra: list[str], results: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    return {
        "model": args.model,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU",
        "cpus": os.cpu_count(),
        "sglang_version": info.get("sglang_version"),
        "plugin_version": info.get("version"),
        "prompts": args.prompts,
        "prompt_tokens": args.prompt_tokens,
        "concurrency": args.concurrency,
        "worker_processes": args.worker_processes,
        "write_concurrency": args.write_concurrency,
        "sglang_args": extra,
        "results": results,
    }


def print_table(
    args: argparse.Namespace,
    config: dict[str, Any],
    info: dict[str, Any],
    results: dict[str, dict[str, Any]],
    console: Console,
) -> None:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    table = Table(
        title=f"{args.model} ({config['num_hidden_layers']} layers, hidden {config['hidden_size']}) on {device}, "
        f"SGLang {info.get('sglang_version', '?')}: {args.prompts} prompts x {args.prompt_tokens} tokens, "
        f"{args.write_concurrency} writer threads per worker process, median of {args.repeats}"
    )
    for column in ("measure", "tokens/s", "ratio to SGLang prefill, capture off", "CPUs busy"):
        table.add_column(column)
    for label, result in results.items():
        concurrency = label.rsplit("@", 1)[1]
        baseline = results.get(f"SGLang prefill, capture off (stock server) @{concurrency}") or results.get(
            f"plain requests on the capture server @{concurrency}"
        )
        ratio = f"{result['tokens_s'] / baseline['tokens_s']:.2f}" if baseline else "-"
        busy = f"{result['cpu_busy']:.0%}" if result.get("cpu_busy") is not None else "-"
        table.add_row(label, f"{result['tokens_s']:.0f}", ratio, busy)
    console.print(table)


if __name__ == "__main__":
    main()
