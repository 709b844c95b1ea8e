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
With two or more prompt counts (`--prompts 48,192`) every measure runs at each, and the table adds its steady rate
between the shortest and the longest run and what a run pays once (the pipeline filling and draining).

Either the servers run already (`--url` is the capture server, `--baseline-url` a stock one, `--shm-dir` the
capture server's shared directory as mounted here), or `--launch` starts each in turn from this Python, which must
have SGLang and the plugin installed (`--sglang-args` go to both launches, e.g. `--mem-fraction-static 0.8`):

    python -m bench.sglang_capture --launch --model llama-3.1-8b-random --prompts 48,192 --prompt-tokens 2048 \\
        --concurrency 8 --worker-processes 2 --reference --json capture.json
    python -m bench.sglang_capture --url http://gpu:30000 --baseline-url http://gpu:30001 \\
        --shm-dir /dev/shm/eagle3 --model /models/target
"""

import argparse
import json
import os
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
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
from eagle3.server_process import server_process, stock_argv
from shared.capture.client import InferenceClient

# What the plugin's launcher also passes (eagle3_sglang_plugin.launch), so that the stock server runs the same
# prefills: token ids in and out, whole prompts in one forward, no prefix cache.
STOCK_FLAGS = ["--skip-tokenizer-init", "--chunked-prefill-size", "-1", "--disable-radix-cache"]


@contextmanager
def sglang_server(
    kind: str, model_dir: Path, *, shm_dir: Path, extra_args: list[str], log: Path, env: dict[str, str] | None = None
) -> Iterator[str]:
    """A SGLang server of this Python as its own process group: "stock" (plugin off, no aux capture) or "capture"
    (the plugin's launcher). Yields its URL once `/health` answers 200; stops every process of it afterwards."""
    port = free_port()
    environ = dict(env or {})
    if kind == "stock":
        environ["SGLANG_PLUGINS"] = "none"
        argv = stock_argv(model_dir, port=port, extra_args=[*STOCK_FLAGS, *extra_args])
    else:
        environ.update(
            EAGLE3_MODEL_PATH=str(model_dir),
            EAGLE3_INFERENCE_HOST="127.0.0.1",
            EAGLE3_INFERENCE_PORT=str(port),
            EAGLE3_SHM_DIR=str(shm_dir),
        )
        argv = ["-m", "eagle3_sglang_plugin.launch", *extra_args]
    with server_process(argv, url=f"http://127.0.0.1:{port}", log=log, env=environ) as url:
        yield url


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


Measure = tuple[str, Callable[[Workload, int], float]]  # (row label, seconds of run r over a workload)


def cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) CPU time of the whole machine since boot, all cores, from /proc/stat; None without it."""
    try:
        first_line = Path("/proc/stat").read_text().split("\n", 1)[0]
    except OSError:
        return None
    fields = [int(value) for value in first_line.split()[1:]]
    idle = fields[3] + fields[4]  # idle and iowait
    return sum(fields) - idle, sum(fields)


def medians(
    measures: list[Measure], repeats: int, works: list[Workload], console: Console
) -> dict[str, dict[str, Any]]:
    """Alternating runs of every measure over every workload; tokens/s of the median run, the runs' seconds, and
    how busy the machine's CPUs were during each run (SGLang, client and worker processes together). A label is
    the measure's, then ", N prompts"."""
    seconds: dict[str, list[float]] = {}
    cpu_busy: dict[str, list[float]] = {}
    tokens: dict[str, int] = {}
    for r in range(repeats):
        for work in works:
            for measure, run in measures:
                label = f"{measure}, {len(work.prompts)} prompts"
                before = cpu_jiffies()
                seconds.setdefault(label, []).append(run(work, r))
                after = cpu_jiffies()
                if before and after and after[1] > before[1]:
                    cpu_busy.setdefault(label, []).append((after[0] - before[0]) / (after[1] - before[1]))
                tokens[label] = work.tokens
                console.log(f"run {r + 1}/{repeats} {label}: {work.tokens / seconds[label][-1]:.0f} tokens/s")
    return {
        label: {
            "tokens": tokens[label],
            "tokens_s": tokens[label] / statistics.median(runs),
            "seconds": [round(s, 3) for s in runs],
            "cpu_busy": round(statistics.median(cpu_busy[label]), 3) if label in cpu_busy else None,
        }
        for label, runs in seconds.items()
    }


def steady_rates(results: dict[str, dict[str, Any]], counts: list[int]) -> dict[str, dict[str, Any]]:
    """Per measure, the rate between its shortest and longest workload: the extra tokens over the extra median
    seconds. What a run pays once (the first batch filling the GPU, the last batch's files written, read and
    committed after the GPU's last forward) cancels out; what is left is the rate a long shard runs at."""
    short, long = min(counts), max(counts)
    steady: dict[str, dict[str, Any]] = {}
    for label, result in results.items():
        measure, _, count = label.rpartition(", ")
        if count != f"{long} prompts" or f"{measure}, {short} prompts" not in results:
            continue
        first = results[f"{measure}, {short} prompts"]
        short_s, long_s = statistics.median(first["seconds"]), statistics.median(result["seconds"])
        rate = (result["tokens"] - first["tokens"]) / (long_s - short_s)
        # seconds(run) = once + tokens / rate, so what the short run paid once:
        once = short_s - first["tokens"] / rate
        steady[f"{measure}, steady ({long} - {short} prompts)"] = {"tokens_s": rate, "fixed_s": round(once, 3)}
    return steady


def stock_measures(url: str, concurrencies: list[int]) -> list[Measure]:
    return [(f"SGLang prefill, capture off (stock server) @{c}", _plain(url, c)) for c in concurrencies]


def capture_measures(url: str, args: argparse.Namespace, shm_dir: Path | None, scratch: Path) -> list[Measure]:
    transports = [t for t in args.transports if t == "body" or shm_dir is not None]
    measures: list[Measure] = []
    for c in args.concurrency:
        measures.append((f"plain requests on the capture server @{c}", _plain(url, c)))
        for transport in transports:
            run = CaptureRun(c, transport, shm_dir, 1, args.write_concurrency)
            measures.append((f"capture driven directly, {transport} @{c}", _direct(url, run)))
            for processes in args.worker_processes:
                run = replace(run, worker_processes=processes)
                label = f"end to end, {transport}, {processes} worker processes @{c}"
                measures.append((label, _end_to_end(url, run, scratch)))
            if args.single_thread_workers:
                # The most processes once more, each with one torch thread: many writer threads' intra-op thread
                # pools compete for the cores that SGLang's scheduler also needs.
                run = replace(run, worker_processes=max(args.worker_processes), torch_threads=1)
                label = f"end to end, {transport}, {run.worker_processes} worker processes, 1 torch thread each @{c}"
                measures.append((label, _end_to_end(url, run, scratch)))
    return measures


def _plain(url: str, concurrency: int) -> Callable[[Workload, int], float]:
    return lambda work, r: plain_prefill_seconds(url, work, concurrency)


def _direct(url: str, run: CaptureRun) -> Callable[[Workload, int], float]:
    return lambda work, r: capture_direct_seconds(
        url, work, run, f"direct-{run.transport}-{run.concurrency}-{len(work.prompts)}/{r}"
    )


def _end_to_end(url: str, run: CaptureRun, scratch: Path) -> Callable[[Workload, int], float]:
    return lambda work, r: end_to_end_seconds(
        url, work, run, scratch / "out" / f"{run.transport}-{run.concurrency}-{len(work.prompts)}-{r}"
    )


def warm_up(measures: list[Measure], work: Workload) -> None:
    """One unmeasured run of each measure on a few prompts: kernels compiled, pinned and shared memory allocated."""
    for _, run in measures:
        run(work, -1)


def int_list(text: str) -> list[int]:
    """A command-line list of counts, e.g. "48,192"."""
    return [int(n) for n in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.1-8b-random", help="llama-3.1-8b-random, smollm2 or a folder")
    parser.add_argument("--prompts", type=int_list, default=[48],
                        help="prompts per run, e.g. 48 or 48,192: with two or more counts the table adds each "
                        "measure's steady rate between the shortest and the longest run")  # fmt: skip
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--concurrency", type=int_list, default=[8],
                        help="requests in flight, e.g. 8 or 8,16; the first is the headline")  # fmt: skip
    parser.add_argument("--transports", type=lambda s: s.split(","), default=["shm", "body"])
    parser.add_argument(
        "--worker-processes",
        type=int_list,
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
    longest = workload(config, max(args.prompts), args.prompt_tokens)
    works = [longest.head(n) for n in sorted(set(args.prompts))]
    warm = longest.head(2 * max(args.concurrency))
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
            measures = stock_measures(url, args.concurrency)
            warm_up(measures, warm)
            results |= medians(measures, args.repeats, works, console)
        save()
        log = args.work / "sglang-capture.log"
        with sglang_server("capture", model_dir, shm_dir=shm_dir, extra_args=extra, log=log) as url:
            info = httpx.get(f"{url}/get_model_info", timeout=30).json()
            measures = capture_measures(url, args, shm_dir, args.work)
            warm_up(measures, warm)
            results |= medians(measures, args.repeats, works, console)
        save()
    else:
        if args.baseline_url:
            measures = stock_measures(args.baseline_url, args.concurrency)
            warm_up(measures, warm)
            results |= medians(measures, args.repeats, works, console)
        info = httpx.get(f"{args.url}/get_model_info", timeout=30).json()
        measures = capture_measures(args.url, args, args.shm_dir, args.work)
        warm_up(measures, warm)
        results |= medians(measures, args.repeats, works, console)
        save()

    if args.reference:  # the longest workload only: the reference backend's numbers are for comparison
        c, n = args.concurrency[0], len(longest.prompts)
        run = CaptureRun(c, "shm", None, max(args.worker_processes), args.write_concurrency)
        scratch = args.work / "reference"
        scratch.mkdir(exist_ok=True)
        rates = reference_rates(
            model_dir, longest, run, batch_tokens=args.reference_batch_tokens, repeats=args.repeats, scratch=scratch
        )
        for label, key in (
            ("reference: bare prefill (model forward, in process)", "bare_prefill_tokens_s"),
            ("reference: server driven directly, shm", "server_direct_tokens_s"),
            (f"reference: end to end, shm, {run.worker_processes} worker processes", "end_to_end_tokens_s"),
        ):
            results[f"{label} @{c}, {n} prompts"] = {"tokens_s": rates[key]}

    if len(works) > 1:
        results |= steady_rates(results, args.prompts)
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
        f"SGLang {info.get('sglang_version', '?')}: {','.join(map(str, args.prompts))} prompts x "
        f"{args.prompt_tokens} tokens, "
        f"{args.write_concurrency} writer threads per worker process, median of {args.repeats}"
    )
    for column in ("measure", "tokens/s", "ratio to SGLang prefill, capture off", "CPUs busy", "once per run, s"):
        table.add_column(column)
    for label, result in results.items():
        concurrency = label.rsplit("@", 1)[1]
        baseline = results.get(f"SGLang prefill, capture off (stock server) @{concurrency}") or results.get(
            f"plain requests on the capture server @{concurrency}"
        )
        ratio = f"{result['tokens_s'] / baseline['tokens_s']:.2f}" if baseline else "-"
        busy = f"{result['cpu_busy']:.0%}" if result.get("cpu_busy") is not None else "-"
        fixed = f"{result['fixed_s']:.2f}" if "fixed_s" in result else "-"
        table.add_row(label, f"{result['tokens_s']:.0f}", ratio, busy, fixed)
    console.print(table)


if __name__ == "__main__":
    main()
