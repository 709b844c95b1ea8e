"""Where a batch-1 decoding step's time goes in SGLang: plain decoding against EAGLE-3 speculative decoding.

`eagle3 eval --engine sglang` measures what a speculative step (the drafts, one verification, the draft model's
extend) costs against a plain token; this says why. Each server in turn (plain, then the drafter at each
`--speculative` setting), once per `--variant` (extra server arguments, applied to every server of that variant),
CUDA graphs on as users serve: warmed, then SGLang's own torch profiler (`/start_profile`, host and GPU activity)
records while `--requests` prompts are decoded one at a time, and the trace is summarised per step:

- period: milliseconds from one decode forward (plain) or one verification (speculative) to the next, within a
  request (windows holding a prefill are left out), under the profiler, which slows the host's every call (2.5x a
  plain token's on an H100); and unprofiled, the same prompts decoded before the profiler starts, less a one-token
  request each, over their steps: the step's real cost;
- GPU busy: the union of kernel and copy intervals per step; against the unprofiled period, how long the GPU waits
  for the host;
- kernels run on the GPU, graphs replayed and kernels launched one by one by the host, and the host's waits for the
  GPU (stream, event and device synchronisations, blocking copies), per step;
- host time in each forward SGLang names (`step[DECODE ...]`, `step[VERIFY ...]`, `step[DRAFT ...]`), per step;
- the kernels that take the GPU's time.

    python -m bench.sglang_step_profile --model /models/smollm2 --drafter /tmp/gpu_drafter/untrained \\
        --prompts-file eval_code.jsonl --speculative 7,1,8 --variant "" --variant "--disable-overlap-schedule" \\
        --sglang-args "--attention-backend triton" --out /tmp/step_profile

`--random-target llama3-8b` measures the same at Llama-3.1-8B dimensions instead, where a plain token is no longer
almost all fixed overhead: SGLang serves a target of random weights (`--load-format dummy`, no tokenizer) and an
EAGLE-3 drafter of random weights this script exports at those dimensions; the drafts are rejected, so the step is
the speculative step at acceptance 1 (a step that accepts more costs a little more), and the prompts are random
token ids. No model files are needed.

    python -m bench.sglang_step_profile --random-target llama3-8b --sglang-args "--attention-backend triton"

Writes `step_profile.json` (every figure) and each server's trace (`*.trace.json.gz`, for Perfetto) under `--out`.
The analysis alone, of a trace recorded elsewhere: `--trace FILE --anchor VERIFY`.
"""

import argparse
import gzip
import json
import shlex
import statistics
import sys
import time
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import torch
from rich.console import Console
from rich.table import Table

from eagle3.engine_eval import SpeculativeConfig, decoding_step_ms, generate, stock_launch, timed_requests
from eagle3.jobs import exit_on_sigterm
from eagle3.local_stack import free_port
from eagle3.server_process import ServerProcessError, server_processes

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
# Host calls that wait for the GPU: what a step spends blocked rather than launching work.
HOST_WAITS = {
    "cudaStreamSynchronize",
    "cudaEventSynchronize",
    "cudaDeviceSynchronize",
    "cudaMemcpy",
    "cuStreamSynchronize",
    "cuEventSynchronize",
    "cuCtxSynchronize",
}
GRAPH_LAUNCHES = {"cudaGraphLaunch", "cuGraphLaunch"}
KERNEL_LAUNCHES = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"}
STEP_SPAN = "step["
# The events counted in the step they start in (a kernel, a host call, a span's GPU time, a Python call).
PER_STEP_CATEGORIES = {"kernel", "cuda_runtime", "cuda_driver", "gpu_user_annotation", "python_function"}
TOP_KERNELS = 12
TOP_PYTHON = 30
# --random-target: the target's decoder layers (its other dimensions are bench.trainer_throughput's), and the length
# of the random prompts.
RANDOM_TARGET_LAYERS = {"llama3-8b": 32, "small": 4}
RANDOM_PROMPT_TOKENS = 160


@dataclass
class Span:
    name: str
    start: float  # microseconds, the trace's clock
    end: float


@dataclass
class StepProfile:
    """Medians per step over a trace's decoding steps (means where a median of small counts would hide them)."""

    anchor: str
    steps: int
    period_ms: float
    gpu_busy_ms: float
    kernels: float
    graph_launches: float
    eager_launches: float
    host_wait_ms: float
    # span (forward kind or stage) -> host ms per step, a median as the period is: a step's spans fit in its period
    span_ms: dict[str, float] = field(default_factory=dict)
    gpu_span_ms: dict[str, float] = field(default_factory=dict)  # the same spans' GPU time per step (median)
    top_kernels: list[tuple[str, float, float]] = field(default_factory=list)  # name, GPU ms per step, count per step
    # With Python stacks recorded: the functions that take the host's time, inclusive ms per step (slower steps)
    python_ms: list[tuple[str, float]] = field(default_factory=list)

    @property
    def gpu_idle(self) -> float:
        return max(0.0, 1 - self.gpu_busy_ms / self.period_ms) if self.period_ms else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "gpu_idle": self.gpu_idle}


def _span_kind(name: str) -> str:
    """'step[VERIFY bs=1]' -> 'VERIFY', 'step[EXTEND bs=1 toks=153]' -> 'EXTEND'; SGLang's stage spans ('draft',
    'draft_extend', 'verify') keep their names."""
    if name.startswith(STEP_SPAN):
        return name[len(STEP_SPAN) :].split(" ", 1)[0].rstrip("]")
    return name


class _Windows:
    """Disjoint, sorted [start, end) windows (microseconds); which one a moment falls in."""

    def __init__(self, windows: list[tuple[float, float]]) -> None:
        self.starts = [w[0] for w in windows]
        self.ends = [w[1] for w in windows]

    def index(self, ts: float) -> int | None:
        i = bisect_right(self.starts, ts) - 1
        return i if i >= 0 and ts < self.ends[i] else None

    def covered(self, intervals: list[tuple[float, float]]) -> list[float]:
        """Milliseconds of each window covered by the union of the intervals."""
        per_window: list[list[tuple[float, float]]] = [[] for _ in self.starts]
        for a, b in intervals:
            i = max(0, bisect_right(self.starts, a) - 1)
            while i < len(self.starts) and self.starts[i] < b:
                lo, hi = max(a, self.starts[i]), min(b, self.ends[i])
                if hi > lo:
                    per_window[i].append((lo, hi))
                i += 1
        covered = []
        for pieces in per_window:
            total, reach = 0.0, float("-inf")
            for lo, hi in sorted(pieces):
                lo = max(lo, reach)
                if hi > lo:
                    total += hi - lo
                    reach = hi
            covered.append(total / 1000)
        return covered


def summarize_trace(events: list[dict[str, Any]], anchor: str) -> StepProfile:
    """Per-step figures of a torch profiler trace of an SGLang server decoding at batch 1.

    `anchor` is the forward that begins a step: DECODE for plain decoding, VERIFY for speculative decoding. A step is
    the window from one anchor's start to the next's; windows holding a prefill (`EXTEND`) span request boundaries
    and are left out."""
    complete = [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]
    annotations = sorted(
        (
            Span(_span_kind(str(e.get("name", ""))), float(e["ts"]), float(e["ts"]) + float(e["dur"]))
            for e in complete
            if e.get("cat") == "user_annotation"
        ),
        key=lambda s: s.start,
    )
    anchors = [s for s in annotations if s.name == anchor]
    prefills = [s.start for s in annotations if s.name == "EXTEND"]
    windows = [(a.start, b.start) for a, b in pairwise(anchors) if not any(a.start <= p < b.start for p in prefills)]
    if not windows:
        kinds = sorted({s.name for s in annotations})
        raise ValueError(
            f"no two consecutive step[{anchor} ...] forwards in the trace ({len(anchors)} found; its spans: {kinds})"
        )
    steps = len(windows)
    where = _Windows(windows)
    gpu = [e for e in complete if e.get("cat") in GPU_CATEGORIES]
    busy = where.covered([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu])

    kernels, graphs, eager, waits = [0] * steps, [0] * steps, [0] * steps, [0.0] * steps
    kernel_totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    gpu_spans: dict[str, list[float]] = defaultdict(lambda: [0.0] * steps)
    python_totals: dict[str, float] = defaultdict(float)
    for e in complete:
        cat = e.get("cat")
        if cat not in PER_STEP_CATEGORIES or (i := where.index(float(e["ts"]))) is None:
            continue
        name, ms = e["name"], float(e["dur"]) / 1000
        if cat == "kernel":
            kernels[i] += 1
            kernel_totals[name][0] += ms
            kernel_totals[name][1] += 1
        elif cat == "gpu_user_annotation":
            gpu_spans[_span_kind(name)][i] += ms
        elif cat == "python_function":
            python_totals[name] += ms
        else:  # the CUDA runtime or driver
            graphs[i] += name in GRAPH_LAUNCHES
            eager[i] += name in KERNEL_LAUNCHES
            waits[i] += ms if name in HOST_WAITS else 0.0
    host_spans: dict[str, list[float]] = defaultdict(lambda: [0.0] * steps)
    for span in annotations:
        if (i := where.index(span.start)) is not None:
            host_spans[span.name][i] += (span.end - span.start) / 1000
    period = statistics.median((b - a) / 1000 for a, b in windows)
    # The scheduler's loop and its callers cover whole steps and say nothing: what takes less than most of a step does.
    python = [(name, total / steps) for name, total in python_totals.items() if total / steps < 0.9 * period]
    top = sorted(kernel_totals.items(), key=lambda item: -item[1][0])[:TOP_KERNELS]
    return StepProfile(
        anchor=anchor,
        steps=steps,
        period_ms=period,
        gpu_busy_ms=statistics.median(busy),
        kernels=statistics.fmean(kernels),
        graph_launches=statistics.fmean(graphs),
        eager_launches=statistics.fmean(eager),
        host_wait_ms=statistics.median(waits),
        span_ms={kind: statistics.median(per_step) for kind, per_step in sorted(host_spans.items())},
        gpu_span_ms={kind: statistics.median(per_step) for kind, per_step in sorted(gpu_spans.items())},
        top_kernels=[(name, total / steps, count / steps) for name, (total, count) in top],
        python_ms=sorted(python, key=lambda item: -item[1])[:TOP_PYTHON],
    )


def read_trace(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as trace:
        data = json.load(trace)
    return data["traceEvents"] if isinstance(data, dict) else data


# ----------------------------------------------------------------------------------------------------------
# Recording


def record(
    url: str,
    prompts: list[list[int]],
    *,
    trace_dir: Path,
    name: str,
    max_new_tokens: int,
    ignore_eos: bool,
    with_stack: bool,
) -> Path:
    """Decode every prompt one at a time under SGLang's profiler; the trace's path. `with_stack` records every Python
    call too (where the host's time goes, at the price of slower steps)."""
    with httpx.Client(timeout=600) as client:
        before = set(trace_dir.glob("*.trace.json.gz"))
        body = {
            "output_dir": str(trace_dir),
            "activities": ["CPU", "GPU"],
            "with_stack": with_stack,
            "profile_prefix": f"{name}{'-stacks' if with_stack else ''}",
        }
        client.post(f"{url}/start_profile", json=body).raise_for_status()
        for prompt in prompts:
            generate(client, url, prompt, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
        client.post(f"{url}/stop_profile").raise_for_status()
    # SGLang answers stop_profile once the trace is exported; should a version answer before, the file is taken
    # once it has stopped growing.
    deadline, sizes = time.monotonic() + 300, dict[Path, int]()
    while time.monotonic() < deadline:
        now = {p: p.stat().st_size for p in set(trace_dir.glob("*.trace.json.gz")) - before}
        done = [p for p, size in now.items() if size > 0 and sizes.get(p) == size]
        if done:
            return done[0]
        sizes = now
        time.sleep(1)
    raise RuntimeError(f"{name}: SGLang wrote no trace to {trace_dir}")


def random_target(dims: str, out: Path) -> tuple[Path, Path]:
    """A target folder SGLang serves with random weights (its config.json alone) and an EAGLE-3 drafter of random
    weights exported for it, at the named dimensions."""
    from bench.trainer_throughput import SHAPES, random_models
    from services.trainer.export import export_sglang
    from shared.capture.protocol import default_aux_layer_ids

    shape, layers = SHAPES[dims], RANDOM_TARGET_LAYERS[dims]
    target = out / f"target-{dims}"
    target.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "num_hidden_layers": layers,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    (target / "config.json").write_text(json.dumps(config, indent=2))
    drafter, _ = random_models(shape)
    drafter.config.aux_layer_ids = default_aux_layer_ids(layers)  # layers this target has
    return target, export_sglang(drafter, out / f"drafter-{dims}")


def launch_arguments(
    setting: SpeculativeConfig | None, drafter: Path | None, *, random_weights: bool, common: str, variant: str
) -> list[str]:
    """SGLang's arguments after the model and address: the setting, small graphs, the random weights' loading, then
    the arguments of every server and the variant's."""
    speculative = setting.launch_args(drafter) if setting is not None and drafter is not None else []
    # The draft loads as the target does unless told: its exported weights, not random ones.
    loading = ["--load-format", "dummy", "--skip-tokenizer-init"] if random_weights else []
    if random_weights and speculative:
        loading += ["--speculative-draft-load-format", "auto"]
    graphs = ["--cuda-graph-max-bs-decode", "4"]  # batch 1 is all this measures: capture only small graphs
    return [*speculative, *graphs, *loading, *shlex.split(common), *shlex.split(variant)]


def unprofiled_step_ms(url: str, prompts: list[list[int]], *, max_new_tokens: int, ignore_eos: bool) -> float | None:
    """Milliseconds a decoding step takes with no profiler attached (which slows the host's every call): the prompts
    decoded at batch 1, a one-token request's time taken off each, over their steps."""
    first_ms, _ = timed_requests(url, prompts, 1, ignore_eos=ignore_eos)
    full_ms, answers = timed_requests(url, prompts, max_new_tokens, ignore_eos=ignore_eos)
    return decoding_step_ms(sum(full_ms), sum(first_ms), sum(a.decoding_steps for a in answers))


def profile_servers(args: argparse.Namespace) -> list[dict[str, Any]]:
    from services.trainer.evaluate import prompts_from_file
    from shared.data.tokenization import ChatTokenizer

    args.out.mkdir(parents=True, exist_ok=True)
    if args.random_target:
        args.model, args.drafter = random_target(args.random_target, args.out)
        generator = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 32000, (RANDOM_PROMPT_TOKENS,), generator=generator).tolist()] * args.requests
    else:
        chat = ChatTokenizer.from_pretrained(args.model)
        prompts = prompts_from_file(args.prompts_file, chat, max_prompts=args.requests)
    # Random weights say anything, EOS too: their answers ignore it, so each is full length.
    random_weights = ignore_eos = bool(args.random_target)
    console = Console(width=200)
    rows: list[dict[str, Any]] = []
    settings: list[SpeculativeConfig | None] = [None, *(args.speculative if args.drafter else [])]
    for variant in args.variant:
        for setting in settings:
            name = ("plain" if setting is None else f"eagle3-{setting.label.replace(',', '-')}") + (
                f"_{'_'.join(a.lstrip('-') for a in shlex.split(variant))}" if variant else ""
            )
            server_args = launch_arguments(
                setting, args.drafter, random_weights=random_weights, common=args.sglang_args, variant=variant
            )
            recording = {
                "trace_dir": args.out,
                "name": name,
                "max_new_tokens": args.max_new_tokens,
                "ignore_eos": ignore_eos,
            }
            started = time.monotonic()
            row: dict[str, Any] = {"server": name, "variant": variant, "setting": setting.label if setting else None}
            try:
                with server_processes(
                    [stock_launch(args.model, free_port(), server_args, args.out / f"{name}.log")]
                ) as (url,):
                    with httpx.Client(timeout=600) as client:  # warmed: first requests compile and allocate
                        for prompt in prompts[:2]:
                            generate(client, url, prompt, max_new_tokens=args.max_new_tokens, ignore_eos=ignore_eos)
                    unprofiled = unprofiled_step_ms(
                        url, prompts, max_new_tokens=args.max_new_tokens, ignore_eos=ignore_eos
                    )
                    trace = record(url, prompts, **recording, with_stack=False)
                    stacks = record(url, prompts[:1], **recording, with_stack=True)
                anchor = "DECODE" if setting is None else "VERIFY"
                summary = summarize_trace(read_trace(trace), anchor)
                summary.python_ms = summarize_trace(read_trace(stacks), anchor).python_ms
                row.update(summary.as_dict(), trace=trace.name, stacks=stacks.name, unprofiled_period_ms=unprofiled)
            except (ServerProcessError, ValueError, RuntimeError, OSError, EOFError, httpx.HTTPError) as exc:
                # A server this set-up does not start, or a trace without the anchor (it came back all the same:
                # `--trace` reads it with another), is a row that says why, not the end of the run.
                row["error"] = str(exc)
                console.print(f"[red]{name}: {exc}")
            row["seconds"] = round(time.monotonic() - started, 1)
            rows.append(row)
            (args.out / "step_profile.json").write_text(json.dumps(rows, indent=2))  # kept if a later server fails
            print_rows([r for r in rows if "error" not in r], console)
    return rows


def print_rows(rows: list[dict[str, Any]], console: Console) -> None:
    table = Table(title="one decoding step at batch 1 (medians over the profiled steps)")
    for column in (
        "server",
        "steps",
        "period ms",
        "unprofiled ms",
        "GPU busy ms",
        "GPU idle",
        "idle unprofiled",
        "kernels",
        "graphs",
        "eager launches",
        "host waits ms",
        "spans' host ms",
        "spans' GPU ms",
    ):
        table.add_column(column, justify="left" if column in ("server", "spans' host ms", "spans' GPU ms") else "right")
    for row in rows:
        unprofiled = row.get("unprofiled_period_ms")
        table.add_row(
            row["server"],
            str(row["steps"]),
            f"{row['period_ms']:.2f}",
            "-" if unprofiled is None else f"{unprofiled:.2f}",
            f"{row['gpu_busy_ms']:.2f}",
            f"{row['gpu_idle']:.0%}",
            "-" if unprofiled is None else f"{max(0.0, 1 - row['gpu_busy_ms'] / unprofiled):.0%}",
            f"{row['kernels']:.0f}",
            f"{row['graph_launches']:.1f}",
            f"{row['eager_launches']:.0f}",
            f"{row['host_wait_ms']:.2f}",
            ", ".join(f"{kind} {ms:.2f}" for kind, ms in row["span_ms"].items()),
            ", ".join(f"{kind} {ms:.2f}" for kind, ms in row.get("gpu_span_ms", {}).items()),
        )
    console.print(table)
    for row in rows:
        kernels = Table(title=f"{row['server']}: the GPU's time per step")
        for column in ("kernel", "ms", "count"):
            kernels.add_column(column, justify="left" if column == "kernel" else "right")
        for name, ms, count in row["top_kernels"]:
            kernels.add_row(name[:90], f"{ms:.3f}", f"{count:.1f}")
        console.print(kernels)
        if row.get("python_ms"):
            python = Table(title=f"{row['server']}: the host's Python per step (inclusive; recorded with stacks)")
            python.add_column("function")
            python.add_column("ms", justify="right")
            for name, ms in row["python_ms"]:
                python.add_row(name[:120], f"{ms:.3f}")
            console.print(python)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="the target model folder SGLang serves")
    parser.add_argument("--drafter", type=Path, help="an EAGLE-3 draft folder (without it: plain servers only)")
    parser.add_argument("--prompts-file", type=Path, help="prompts, as `eagle3 eval --prompts-file` reads them")
    parser.add_argument(
        "--speculative",
        type=SpeculativeConfig.parse,
        action="append",
        help="STEPS,TOPK,DRAFT_TOKENS; repeat for several (default 7,1,8)",
    )
    parser.add_argument(
        "--variant",
        action="append",
        help="extra server arguments for every server of a variant; repeat (default: one, none)",
    )
    parser.add_argument("--sglang-args", default="", help="arguments every server gets")
    parser.add_argument("--requests", type=int, default=4, help="prompts decoded under the profiler")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("/tmp/step_profile"))
    parser.add_argument(
        "--random-target",
        choices=sorted(RANDOM_TARGET_LAYERS),
        help="serve a target and a drafter of random weights at these dimensions instead of --model and --drafter",
    )
    parser.add_argument("--trace", type=Path, help="only summarise this trace (no server is launched)")
    parser.add_argument("--anchor", default="VERIFY", help="with --trace: DECODE (plain) or VERIFY (speculative)")
    args = parser.parse_args()
    if args.trace:
        summary = summarize_trace(read_trace(args.trace), args.anchor)
        print_rows([{"server": args.trace.name, **summary.as_dict()}], Console(width=200))
        return
    if not args.random_target and (args.model is None or args.prompts_file is None):
        parser.error("--model and --prompts-file (or --random-target) are needed to launch servers")
    exit_on_sigterm()  # a time limit's SIGTERM stops the server this run launched, as Ctrl-C does
    args.speculative = args.speculative or [SpeculativeConfig(7, 1, 8)]
    args.variant = args.variant or [""]
    rows = profile_servers(args)
    if any("error" in row for row in rows):
        sys.exit(f"{sum('error' in row for row in rows)} of {len(rows)} servers measured nothing (see above)")


if __name__ == "__main__":
    main()
