"""Acceptance and speedup as the serving engine measures them (`eagle3 eval --engine sglang`).

The drafter is exported for SGLang and served by SGLang's own EAGLE-3 speculative decoding, CUDA graphs on as a
user serves it, next to a plain server of the same target. For every prompt of each file, decoded greedily:

- acceptance length from SGLang's own per-request counters: (completion tokens - 1) / verification steps, the
  first token coming from the prefill (`spec_verify_ct`); the mean over prompts with a 95% interval, pooled too;
- acceptance per draft position from SGLang's histogram of correct drafts per step, where it sends one;
- tokens/s with and without speculation at batch 1 (one request at a time) and at `--concurrency` requests in
  flight (the file's prompts repeated to at least twice that many requests), medians of `--repeats` runs; their
  ratio is the speedup;
- how many outputs are token for token what the plain server decodes greedily;
- beside it, the project's own measured acceptance (services/trainer/speculative.py) on the same prompts, at the
  first setting when it is a chain (topk 1): where the two differ by more than 10% the report says so with both
  numbers.

Speculative settings (`steps,topk,draft_tokens`, SGLang's `--speculative-num-steps`, `--speculative-eagle-topk`,
`--speculative-num-draft-tokens`) can be several: each is served in turn and the table says which served best.
Either the servers are launched here (from `--sglang-python`, default this one), or `--url` is a running
speculative server (its settings are read from it) and `--plain-url` a plain one.

Launched servers write what they measured to the work folder after each server and each of our own measurements
(`engine-eval-partial.json`); `resume` goes on from there, measuring only what is missing, as long as the target,
the drafters, the prompts and the settings are the ones measured before. A lent GPU machine that runs one command for
minutes at a time finishes an evaluation over several commands that way.
"""

import argparse
import hashlib
import json
import logging
import math
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from pydantic import TypeAdapter
from rich.console import Console
from rich.table import Table

from eagle3.local_stack import free_port
from eagle3.server_process import ServerLaunch, ServerProcessError, server_processes, stock_argv
from shared import intervals
from shared.errors import ConfigurationError, Eagle3Error
from shared.settings import Settings

if TYPE_CHECKING:  # the trainer's modules bring torch and transformers: imported where they run, not by the CLI
    from services.trainer.drafter import Eagle3Drafter

logger = logging.getLogger(__name__)

DISAGREEMENT = 0.10  # relative difference between SGLang's and our acceptance length that the report flags
REQUEST_TIMEOUT_S = 600.0
WARMUP_REQUESTS = 4
# New tokens of the short batch-1 requests that, beside the full-length ones, tell a request's fixed cost from its
# steps' (`ServerRun.request_fixed_ms`): a few speculative steps, an eighth of the default answer.
SHORT_REQUEST_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """One EAGLE-3 serving setting: draft steps, candidates per step, tokens verified per step."""

    steps: int
    topk: int
    draft_tokens: int

    @classmethod
    def parse(cls, text: str) -> "SpeculativeConfig":
        """'STEPS,TOPK,DRAFT_TOKENS', e.g. '7,1,8' (a chain of 7 drafts) or '5,4,16' (a tree)."""
        try:
            steps, topk, draft_tokens = (int(part) for part in text.split(","))
        except ValueError:
            raise ConfigurationError(
                f"speculative setting {text!r}: expected STEPS,TOPK,DRAFT_TOKENS, e.g. 7,1,8"
            ) from None
        config = cls(steps, topk, draft_tokens)
        config.check()
        return config

    def check(self) -> None:
        if self.steps < 1 or self.topk < 1 or self.draft_tokens < 2:
            raise ConfigurationError(f"speculative setting {self.label}: steps and topk >= 1, draft tokens >= 2")
        # SGLang silently resets draft tokens to steps + 1 for a chain; the table must say what really ran.
        if self.topk == 1 and self.draft_tokens != self.steps + 1:
            raise ConfigurationError(
                f"speculative setting {self.label}: with topk 1 SGLang verifies steps + 1 = {self.steps + 1} tokens"
            )
        if self.draft_tokens > self.steps * self.topk + 1:
            raise ConfigurationError(
                f"speculative setting {self.label}: at most steps * topk + 1 = {self.steps * self.topk + 1} "
                "draft tokens can be verified"
            )

    @property
    def label(self) -> str:
        return f"{self.steps},{self.topk},{self.draft_tokens}"

    @property
    def chain(self) -> bool:
        """A single chain of drafts: what the project's own speculative decoding measures too."""
        return self.topk == 1

    def launch_args(self, draft_model_dir: Path | str) -> list[str]:
        return [
            "--speculative-algorithm",
            "EAGLE3",
            "--speculative-draft-model-path",
            str(draft_model_dir),
            "--speculative-num-steps",
            str(self.steps),
            "--speculative-eagle-topk",
            str(self.topk),
            "--speculative-num-draft-tokens",
            str(self.draft_tokens),
        ]

    @classmethod
    def from_server_info(cls, info: dict[str, Any]) -> "SpeculativeConfig":
        """The setting a running server was launched with (its `/server_info`)."""
        if (info.get("speculative_algorithm") or "").upper() not in ("EAGLE3", "EAGLE"):
            raise ConfigurationError(
                f"the server at --url serves no EAGLE-3 drafter (speculative_algorithm "
                f"{info.get('speculative_algorithm')!r})"
            )
        return cls(
            int(info["speculative_num_steps"]),
            int(info["speculative_eagle_topk"]),
            int(info["speculative_num_draft_tokens"]),
        )


# ----------------------------------------------------------------------------------------------------------
# One server, driven


@dataclass
class Completion:
    """One greedy `/generate` answer: the new tokens and, from a speculative server, its counters."""

    output_ids: list[int]
    verify_steps: int | None = None  # spec_verify_ct: target verification forwards after the prefill
    correct_drafts_histogram: list[int] | None = None  # [j] = verification steps that accepted j drafts

    @classmethod
    def from_response(cls, body: dict[str, Any]) -> "Completion":
        meta = body.get("meta_info") or {}
        output_ids = body.get("output_ids")
        if output_ids is None:
            raise Eagle3Error(f"SGLang answered without output_ids: {sorted(body)}")
        verify_steps = meta.get("spec_verify_ct")
        return cls(
            output_ids=list(output_ids),
            verify_steps=int(verify_steps) if verify_steps is not None else None,
            correct_drafts_histogram=meta.get("spec_correct_drafts_histogram"),
        )

    @property
    def decoding_steps(self) -> int:
        """Forwards after the prefill: SGLang's verifications where it counts them, else the tokens after the first."""
        return self.verify_steps if self.verify_steps is not None else len(self.output_ids) - 1

    @property
    def acceptance_length(self) -> float | None:
        """Tokens per verification step, the bonus token included; the prefill's first token is not a step's."""
        if not self.verify_steps:
            return None
        return (len(self.output_ids) - 1) / self.verify_steps


def generate(
    client: httpx.Client, url: str, prompt: list[int], *, max_new_tokens: int, ignore_eos: bool = False
) -> Completion:
    """One greedy answer; `ignore_eos` decodes all `max_new_tokens` (a target with random weights says anything)."""
    sampling = {"max_new_tokens": max_new_tokens, "temperature": 0.0, **({"ignore_eos": True} if ignore_eos else {})}
    body = {"input_ids": prompt, "sampling_params": sampling}
    try:
        response = client.post(f"{url}/generate", json=body)
    except httpx.RemoteProtocolError:
        # A pooled connection the server had closed as idle (its keep-alive is 5 s) fails like this before the request
        # reaches it; seen with 512 threads on one client on the H200, 2026-12-04. A greedy decode is safe to send
        # again on a new connection; a server that really went away fails this one with a connection error.
        response = client.post(f"{url}/generate", json=body)
    if response.status_code != 200:
        raise Eagle3Error(f"SGLang at {url} answered {response.status_code}: {response.text[:300]}")
    return Completion.from_response(response.json())


def decode_all(
    url: str, prompts: list[list[int]], *, max_new_tokens: int, concurrency: int = 1
) -> tuple[list[Completion], float]:
    """Every prompt, `concurrency` requests in flight, in order; returns the answers and the wall seconds."""
    with httpx.Client(timeout=REQUEST_TIMEOUT_S, limits=httpx.Limits(max_connections=concurrency)) as client:
        started = time.perf_counter()
        if concurrency == 1:
            completions = [generate(client, url, prompt, max_new_tokens=max_new_tokens) for prompt in prompts]
        else:
            with ThreadPoolExecutor(concurrency) as pool:
                completions = list(
                    pool.map(lambda prompt: generate(client, url, prompt, max_new_tokens=max_new_tokens), prompts)
                )
        return completions, time.perf_counter() - started


def load_requests(prompts: list[list[int]], concurrency: int) -> list[list[int]]:
    """The prompts, repeated until there are at least twice `concurrency` requests: the server stays loaded for
    most of the run instead of draining a single wave."""
    repeats = max(1, math.ceil(2 * concurrency / len(prompts)))
    return [prompt for _ in range(repeats) for prompt in prompts]


@dataclass
class ServerRun:
    """What one server did on one prompt file."""

    completions: list[Completion]  # batch 1, in prompt order
    tokens_per_s: float  # batch 1, median over repeats
    concurrent_tokens_per_s: float | None  # at `concurrency` in flight, median over repeats
    first_token_ms: float | None = None  # batch 1, median over the prompts of a request for one new token
    short_request_ms: float | None = None  # batch 1, mean over the prompts of a request for SHORT_REQUEST_TOKENS
    short_request_steps: float | None = None  # its mean decoding steps (verifications; plain: tokens after the first)

    def request_fixed_ms(self) -> float | None:
        """Milliseconds a batch-1 request costs besides its decoding steps (prefill, scheduling, the HTTP round
        trip), from two request lengths: the full runs' and the short requests' mean time against their mean steps,
        a line whose intercept this is. None where the two lengths took the same steps or one is missing."""
        full_steps = _mean_steps(self.completions)
        if self.short_request_ms is None or self.short_request_steps is None or full_steps is None:
            return None
        full_ms = 1000 * sum(len(c.output_ids) for c in self.completions) / self.tokens_per_s / len(self.completions)
        if full_steps - self.short_request_steps < 1:
            return None
        step_ms = (full_ms - self.short_request_ms) / (full_steps - self.short_request_steps)
        return self.short_request_ms - step_ms * self.short_request_steps


def _mean_steps(completions: list[Completion]) -> float | None:
    """Mean decoding steps a request."""
    if not completions:
        return None
    return statistics.fmean(c.decoding_steps for c in completions)


def timed_requests(
    url: str, prompts: list[list[int]], max_new_tokens: int, *, ignore_eos: bool = False
) -> tuple[list[float], list[Completion]]:
    """Milliseconds and answers, one request at a time, of a request for `max_new_tokens` per prompt."""
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        latencies, completions = [], []
        for prompt in prompts:
            started = time.perf_counter()
            completions.append(generate(client, url, prompt, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos))
            latencies.append(1000 * (time.perf_counter() - started))
    return latencies, completions


def run_server(url: str, prompts: list[list[int]], *, max_new_tokens: int, concurrency: int, repeats: int) -> ServerRun:
    """Batch 1 `repeats` times (the first run's answers are kept), then `concurrency` in flight `repeats` times."""
    decode_all(url, prompts[:WARMUP_REQUESTS], max_new_tokens=max_new_tokens)
    # A one-token request is the prefill and a request's fixed costs, which a batch-1 rate pays once per prompt
    # besides its decoding steps; short requests beside the full ones tell those costs from the steps'.
    first_token_ms = statistics.median(timed_requests(url, prompts, 1)[0])
    short_latencies, short_completions = timed_requests(url, prompts, SHORT_REQUEST_TOKENS)
    short_ms, short_steps = statistics.fmean(short_latencies), _mean_steps(short_completions)
    rates, completions = [], []
    for index in range(repeats):
        answers, seconds = decode_all(url, prompts, max_new_tokens=max_new_tokens)
        rates.append(sum(len(a.output_ids) for a in answers) / seconds)
        if index == 0:
            completions = answers
    concurrent = None
    if concurrency > 1:
        requests = load_requests(prompts, concurrency)
        concurrent_rates = []
        for _ in range(repeats):
            answers, seconds = decode_all(url, requests, max_new_tokens=max_new_tokens, concurrency=concurrency)
            concurrent_rates.append(sum(len(a.output_ids) for a in answers) / seconds)
        concurrent = statistics.median(concurrent_rates)
    return ServerRun(completions, statistics.median(rates), concurrent, first_token_ms, short_ms, short_steps)


# ----------------------------------------------------------------------------------------------------------
# Acceptance from SGLang's counters


@dataclass
class EngineAcceptance:
    prompts: int
    new_tokens: int
    verify_steps: int
    acceptance_length: float  # mean over prompts of (completion - 1) / verification steps
    acceptance_length_ci95: tuple[float, float]
    pooled_acceptance_length: float  # all (completion - 1) over all verification steps
    position_acceptance: list[float]  # share of steps whose draft k+1 was accepted; empty without a histogram


def engine_acceptance(completions: list[Completion]) -> EngineAcceptance:
    """SGLang's counters of every prompt, summed and averaged as `eagle3 eval` averages its own."""
    measured = [c for c in completions if c.verify_steps]
    if len(measured) < len(completions):
        logger.info(
            "%d of %d prompts ended before any verification step", len(completions) - len(measured), len(completions)
        )
    lengths = [c.acceptance_length for c in measured if c.acceptance_length is not None]
    steps = sum(c.verify_steps or 0 for c in measured)
    after_prefill = sum(len(c.output_ids) - 1 for c in measured)
    return EngineAcceptance(
        prompts=len(completions),
        new_tokens=sum(len(c.output_ids) for c in completions),
        verify_steps=steps,
        acceptance_length=intervals.mean(lengths),
        acceptance_length_ci95=intervals.mean_ci95(lengths),
        pooled_acceptance_length=after_prefill / steps if steps else math.nan,
        position_acceptance=position_acceptance(measured),
    )


def position_acceptance(completions: list[Completion]) -> list[float]:
    """From the per-request histograms of correct drafts per step: the share of steps that accepted draft k+1
    (k+1 or more drafts correct). Empty when SGLang sent no histogram."""
    histograms = [c.correct_drafts_histogram for c in completions if c.correct_drafts_histogram]
    if not histograms:
        return []
    width = max(len(h) for h in histograms)
    totals = [sum(h[j] for h in histograms if j < len(h)) for j in range(width)]
    steps = sum(totals)
    return [sum(totals[j] for j in range(k + 1, width)) / steps for k in range(width - 1)] if steps else []


def matching_outputs(completions: list[Completion], reference: list[Completion]) -> int:
    return sum(a.output_ids == b.output_ids for a, b in zip(completions, reference, strict=True))


# ----------------------------------------------------------------------------------------------------------
# The whole measurement


@dataclass
class EngineResult:
    """One drafter, one setting, one prompt file: a row of the table."""

    file: str
    drafter: str  # "trained", "untrained" (--baseline) or "served" (--url)
    setting: str  # steps,topk,draft_tokens
    acceptance: EngineAcceptance
    matches_greedy: int | None  # outputs equal to the plain server's greedy ones (None without a plain server)
    tokens_per_s: float
    plain_tokens_per_s: float | None
    concurrent_tokens_per_s: float | None
    plain_concurrent_tokens_per_s: float | None
    own_acceptance_length: float | None = None  # the project's own measured acceptance on the same prompts
    notes: list[str] = field(default_factory=list)
    first_token_ms: float | None = None  # `ServerRun.first_token_ms` of this server and of the plain one
    plain_first_token_ms: float | None = None
    plain_new_tokens: int | None = None  # the plain server's batch-1 tokens on the same prompts
    request_fixed_ms: float | None = None  # `ServerRun.request_fixed_ms` of this server and of the plain one
    plain_request_fixed_ms: float | None = None

    @property
    def speedup(self) -> float | None:
        return self.tokens_per_s / self.plain_tokens_per_s if self.plain_tokens_per_s else None

    @property
    def break_even_acceptance(self) -> float | None:
        """The acceptance length at which this setting would decode as fast as plain at batch 1: the time of a
        speculative step, per-request costs spread over its steps as measured, in plain tokens (its tokens over its
        rate, against one over plain's). `step_ms` and `first_token_ms` tell the step's own cost from those."""
        length = self.acceptance.acceptance_length
        if not self.plain_tokens_per_s or not self.tokens_per_s or not math.isfinite(length):
            return None
        return length * self.plain_tokens_per_s / self.tokens_per_s

    @property
    def step_ms(self) -> float | None:
        """Milliseconds per verification step at batch 1 once the first token is out: the batch-1 time less a
        first-token latency per prompt, over SGLang's verification steps."""
        acceptance = self.acceptance
        return _decode_ms(
            acceptance.new_tokens, self.tokens_per_s, acceptance.prompts, self.first_token_ms, acceptance.verify_steps
        )

    @property
    def plain_token_ms(self) -> float | None:
        """The same for the plain server: milliseconds per token after the first."""
        if self.plain_new_tokens is None or not self.plain_tokens_per_s:
            return None
        tokens, prompts = self.plain_new_tokens, self.acceptance.prompts
        return _decode_ms(tokens, self.plain_tokens_per_s, prompts, self.plain_first_token_ms, tokens - prompts)

    @property
    def concurrent_speedup(self) -> float | None:
        if self.concurrent_tokens_per_s is None or not self.plain_concurrent_tokens_per_s:
            return None
        return self.concurrent_tokens_per_s / self.plain_concurrent_tokens_per_s

    def compare_with_own(self, own: float) -> None:
        self.own_acceptance_length = own
        engine = self.acceptance.acceptance_length
        if math.isfinite(own) and math.isfinite(engine) and abs(engine - own) > DISAGREEMENT * own:
            self.notes.append(
                f"SGLang's acceptance length {engine:.3f} and the project's own {own:.3f} differ by "
                f"{abs(engine - own) / own:.0%} (more than {DISAGREEMENT:.0%}) on the same prompts"
            )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "speedup": self.speedup,
            "break_even_acceptance": self.break_even_acceptance,
            "step_ms": self.step_ms,
            "plain_token_ms": self.plain_token_ms,
            "concurrent_speedup": self.concurrent_speedup,
        }


def _decode_ms(
    new_tokens: int, tokens_per_s: float, prompts: int, first_token_ms: float | None, steps: int
) -> float | None:
    """`decoding_step_ms` of a run known by its rate: its time is its tokens over that rate, and each prompt's first
    token took `first_token_ms`; None where a number is missing."""
    if first_token_ms is None or not tokens_per_s:
        return None
    return decoding_step_ms(1000 * new_tokens / tokens_per_s, prompts * first_token_ms, steps)


def decoding_step_ms(run_ms: float, first_tokens_ms: float, steps: int) -> float | None:
    """Batch-1 milliseconds per decoding step: a run's time less its requests' first tokens (their prefills), over
    its steps; None where there are no steps or the difference is not a time."""
    decoding_ms = run_ms - first_tokens_ms
    return decoding_ms / steps if steps > 0 and decoding_ms > 0 else None


@dataclass
class EngineEvalOptions:
    settings: list[SpeculativeConfig]
    max_new_tokens: int = 64
    concurrency: int = 16
    repeats: int = 2
    max_prompts: int | None = None
    compare_own: bool = True
    own_drafters: tuple[str, ...] | None = None  # the drafters the own measurement decodes with (default: each)
    url: str | None = None  # a running speculative server instead of launching
    plain_url: str | None = None  # a running plain server instead of launching
    sglang_python: str = sys.executable
    sglang_args: list[str] = field(default_factory=list)  # every launch gets them
    work_dir: Path | None = None  # exports and server logs (default: a temporary folder)
    resume: bool = False  # go on from the work folder's partial measurements (launched servers only)


@dataclass
class DrafterSource:
    """What the evaluation serves and where it came from: a checkpoint of a run, or an EAGLE-3 folder that SGLang
    serves (an export of ours or another trainer's), which names no run and no target."""

    name: str  # the checkpoint's key or the folder
    target: Path
    trained: "Eagle3Drafter"
    untrained: "Eagle3Drafter | None"  # with --baseline: the warm start the trained drafter began from
    job_id: str | None = None
    step: int | None = None


def drafters_from_checkpoint(ref: str, *, settings: Settings, model_path: str | None, baseline: bool) -> DrafterSource:
    from services.trainer.checkpoint import drafter_from_checkpoint, load_checkpoint
    from services.trainer.evaluate import untrained_drafter
    from shared.storage.objects import open_storage

    checkpoint = load_checkpoint(ref, open_storage(settings.storage_url, settings))
    target = Path(model_path or checkpoint.model_path)
    trained = drafter_from_checkpoint(checkpoint, model_path=target)[0]
    untrained = untrained_drafter(checkpoint, target) if baseline else None
    return DrafterSource(checkpoint.source, target, trained, untrained, checkpoint.job_id, checkpoint.step)


def drafters_from_folder(folder: Path, *, model_path: str | None, baseline: bool) -> DrafterSource:
    """An SGLang EAGLE-3 folder (config.json, model.safetensors with d2t and t2d) around the target at --model; the
    untrained drafter is the warm start from the target with the folder's draft vocabulary and aux layers."""
    from services.trainer.config import TrainConfig
    from services.trainer.evaluate import warm_start_drafter
    from services.trainer.export import load_sglang_export
    from shared.data.vocab import VocabMapping

    if model_path is None:
        raise ConfigurationError(f"--drafter {folder}: give the target's folder with --model (a draft folder has none)")
    target = Path(model_path)
    trained = load_sglang_export(folder, target_path=target)
    untrained = None
    if baseline:
        vocab = VocabMapping(trained.d2t.clone(), trained.t2d.clone(), None, trained.config.draft_vocab_size)
        aux_layer_ids = list(trained.config.aux_layer_ids)
        seed = TrainConfig.model_fields["seed"].default  # a run's default seed
        untrained = warm_start_drafter(target, vocab, aux_layer_ids=aux_layer_ids, seed=seed)
    return DrafterSource(str(folder), target, trained, untrained)


def evaluate_on_engine(source: DrafterSource, files: list[Path], *, options: EngineEvalOptions) -> dict[str, Any]:
    from services.trainer.evaluate import prompts_from_file
    from shared.data.tokenization import ChatTokenizer

    target = source.target
    chat = ChatTokenizer.from_pretrained(target)
    prompt_sets = {str(path): prompts_from_file(path, chat, max_prompts=options.max_prompts) for path in files}
    drafters: dict[str, Eagle3Drafter] = {}
    if options.url is None:
        drafters["trained"] = source.trained
        if source.untrained is not None:
            drafters["untrained"] = source.untrained
    elif source.untrained is not None:
        raise ConfigurationError("--baseline needs the servers launched here: it cannot change what --url serves")

    with _work_dir(options.work_dir) as work:
        if options.url is not None:
            results, headline = measure_running(options, prompt_sets)
            progress = EvalProgress(work / EvalProgress.FILE, key={}, results=results)
            if options.compare_own:
                drafters["served"] = source.trained
        else:
            progress = measure_launched(target, drafters, prompt_sets, options, work)
            results, headline = progress.results, options.settings[0]
        if options.compare_own:
            try:
                own = {n: d for n, d in drafters.items() if options.own_drafters is None or n in options.own_drafters}
                _compare_with_own(
                    results,
                    own,
                    prompt_sets,
                    target,
                    headline,
                    options.max_new_tokens,
                    on_measured=progress.save,
                )
            except Exception as exc:  # SGLang's numbers stand without ours; say why ours are missing
                logger.exception("the project's own acceptance could not be measured")
                for result in results:
                    result.notes.append(f"the project's own acceptance was not measured: {exc!r}")
    for result in results:
        for note in result.notes:
            logger.warning("%s, %s drafter, setting %s: %s", result.file, result.drafter, result.setting, note)
    return {
        "checkpoint": source.name,
        "job_id": source.job_id,
        "step": source.step,
        "engine": "sglang",
        "max_new_tokens": options.max_new_tokens,
        "concurrency": options.concurrency,
        "repeats": options.repeats,
        "launch": "one server at a time" if options.url is None else "running servers",
        "best_setting": best_setting(results),
        "results": [result.as_dict() for result in results],
        "refused": progress.refused,
    }


@contextmanager
def _work_dir(path: Path | None) -> Iterator[Path]:
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="eagle3-engine-eval-") as scratch:
        yield Path(scratch)


def _run(url: str, prompts: list[list[int]], options: EngineEvalOptions) -> ServerRun:
    return run_server(
        url, prompts, max_new_tokens=options.max_new_tokens, concurrency=options.concurrency, repeats=options.repeats
    )


def measure_running(
    options: EngineEvalOptions, prompt_sets: dict[str, list[list[int]]]
) -> tuple[list[EngineResult], SpeculativeConfig]:
    """`--url` (and `--plain-url`): servers someone else launched."""
    assert options.url is not None
    plain = {f: _run(options.plain_url, p, options) for f, p in prompt_sets.items()} if options.plain_url else None
    try:
        served = SpeculativeConfig.from_server_info(server_info(options.url))
    except KeyError:  # a server that does not report its setting: the one given
        served = options.settings[0]
    runs = {f: _run(options.url, p, options) for f, p in prompt_sets.items()}
    return _rows("served", served, runs, plain), served


def measure_launched(
    target: Path,
    drafters: dict[str, "Eagle3Drafter"],
    prompt_sets: dict[str, list[list[int]]],
    options: EngineEvalOptions,
    work: Path,
) -> "EvalProgress":
    """The plain server and one per drafter and setting, launched here one after another, each measured alone.
    What was measured is written after every server (`EvalProgress`); with `options.resume`, what was measured
    before is not measured again."""
    from services.trainer.export import export_sglang

    progress = EvalProgress.start(work, evaluation_key(target, drafters, prompt_sets, options), options.resume)
    plain_port = free_port()
    servers: list[tuple[str | None, SpeculativeConfig | None, ServerLaunch]] = [
        (None, None, stock_launch(target, plain_port, serving_args(options, None), work / "sglang-plain.log"))
    ]
    for name, drafter in drafters.items():
        export_dir = export_sglang(drafter, work / f"drafter-{name}")
        # The untrained drafter is the yardstick at the headline (first) setting; the sweep is the trained one's.
        for setting in options.settings if name != "untrained" else options.settings[:1]:
            log = work / name / f"sglang-{setting.label.replace(',', '-')}.log"
            args = serving_args(options, setting, export_dir)
            servers.append((name, setting, stock_launch(target, free_port(), args, log)))

    def measure(drafter: str | None, setting: SpeculativeConfig | None, url: str) -> None:
        logger.info("measuring %s at %s", f"{drafter} drafter, setting {setting.label}" if setting else "plain", url)
        runs = {f: _run(url, p, options) for f, p in prompt_sets.items()}
        if drafter is None or setting is None:
            progress.plain = runs
        else:
            progress.results.extend(_rows(drafter, setting, runs, progress.plain))
        progress.save()

    # One server at a time, each with the whole GPU: SGLang 0.5.23 profiles the free memory before and after loading
    # its weights, so servers starting side by side see each other's KV pools as their own weights and refuse to
    # start (seen on the H200, 2026-12-03: "Loaded weights leave no GPU memory for the KV cache").
    for drafter_name, server_setting, launch in servers:  # not drafter, setting: those are typed by the loop above
        if progress.measured(drafter_name, server_setting):
            logger.info("measured before (%s): %s %s", progress.path, drafter_name or "plain", server_setting or "")
            continue
        try:
            with server_processes([launch], python=options.sglang_python) as (url,):
                measure(drafter_name, server_setting, url)
        except ServerProcessError as exc:
            if drafter_name is None or server_setting is None:
                raise  # without the plain server there is nothing to compare with
            # A setting this SGLang set-up does not serve (a tree on some attention backends, say) is a row of the
            # sweep that says why, not the end of the sweep.
            logger.error("%s drafter, setting %s: not served: %s", drafter_name, server_setting.label, exc)
            progress.refused.append({"drafter": drafter_name, "setting": server_setting.label, "reason": str(exc)})
            progress.save()
    return progress


@dataclass
class EvalProgress:
    """What launched servers and our own decoding measured so far, in the work folder after each measurement: minutes
    of GPU each, kept whatever comes next (a lent machine's command limit, say), and taken up by `resume`."""

    FILE = "engine-eval-partial.json"

    path: Path
    key: dict[str, Any]  # what the measurements are of (`evaluation_key`): a resume with another key starts afresh
    plain: dict[str, ServerRun] | None = None  # the plain server's runs per file
    results: list[EngineResult] = field(default_factory=list)
    refused: list[dict[str, str]] = field(default_factory=list)  # drafter, setting, reason: servers that never came up

    @classmethod
    def start(cls, work: Path, key: dict[str, Any], resume: bool) -> "EvalProgress":
        progress = cls(work / cls.FILE, key)
        if not resume or not progress.path.exists():
            return progress
        saved = json.loads(progress.path.read_text())
        if saved.get("key") != key:
            logger.warning(
                "%s measured something else (another drafter, prompts or settings): starting afresh", progress.path
            )
            return progress
        progress.plain = _PLAIN_RUNS.validate_python(saved["plain"]) if saved.get("plain") is not None else None
        progress.results = [_RESULT.validate_python(result) for result in saved["results"]]
        progress.refused = saved.get("refused", [])
        logger.info("resuming from %s: %d rows measured before", progress.path, len(progress.results))
        return progress

    def measured(self, drafter: str | None, setting: SpeculativeConfig | None) -> bool:
        if drafter is None or setting is None:
            return self.plain is not None
        done = [(r.drafter, r.setting) for r in self.results] + [(r["drafter"], r["setting"]) for r in self.refused]
        return (drafter, setting.label) in done

    def save(self) -> None:
        plain = {f: asdict(run) for f, run in self.plain.items()} if self.plain is not None else None
        results = [r.as_dict() for r in self.results]
        saved = {"key": self.key, "plain": plain, "results": results, "refused": self.refused}
        self.path.write_text(json.dumps(saved, indent=2))


_PLAIN_RUNS = TypeAdapter(dict[str, ServerRun])
_RESULT = TypeAdapter(EngineResult)


def evaluation_key(
    target: Path,
    drafters: dict[str, "Eagle3Drafter"],
    prompt_sets: dict[str, list[list[int]]],
    options: EngineEvalOptions,
) -> dict[str, Any]:
    """What makes two evaluations' measurements the same: the target, each drafter's weights (a digest), the prompts
    and every option a measurement depends on."""

    def digest(payload: bytes) -> str:
        return hashlib.sha256(payload).hexdigest()[:16]

    def weights(drafter: "Eagle3Drafter") -> str:
        hasher = hashlib.sha256()
        for tensor in drafter.state_dict().values():
            hasher.update(tensor.detach().cpu().float().numpy().tobytes())
        return hasher.hexdigest()[:16]

    return {
        "target": str(target),
        "drafters": {name: weights(drafter) for name, drafter in drafters.items()},
        "prompts": {file: digest(json.dumps(prompts).encode()) for file, prompts in prompt_sets.items()},
        "settings": [setting.label for setting in options.settings],
        "max_new_tokens": options.max_new_tokens,
        "concurrency": options.concurrency,
        "repeats": options.repeats,
        "sglang_args": options.sglang_args,
    }


def serving_args(
    options: EngineEvalOptions, setting: SpeculativeConfig | None, draft_dir: Path | None = None
) -> list[str]:
    """Launch arguments after the model and address: the speculative setting, then what the user adds."""
    speculative = setting.launch_args(draft_dir) if setting is not None and draft_dir is not None else []
    # CUDA graphs on, as users serve, covering every batch the measurement runs (1 and --concurrency). SGLang sizes
    # them by default for a few hundred requests on a large GPU, and capturing those took 80 s of each server's start
    # on the H200 (2026-12-03) for batches this evaluation never runs; a graph size given in --sglang-args wins.
    graphs = (
        []
        if any(arg.startswith("--cuda-graph") for arg in options.sglang_args)
        else [
            "--cuda-graph-max-bs-decode",
            str(max(options.concurrency, 1)),
        ]
    )
    return [*speculative, *graphs, *options.sglang_args]


def stock_launch(target: Path, port: int, args: list[str], log: Path) -> ServerLaunch:
    """A stock SGLang server of `target` on loopback, as the measurements launch it."""
    # SGLANG_PLUGINS=none: the capture plugin, where installed, stays out of a serving measurement.
    argv = stock_argv(target, port=port, extra_args=args)
    return ServerLaunch(argv, f"http://127.0.0.1:{port}", log, {"SGLANG_PLUGINS": "none"})


def _rows(
    drafter: str, setting: SpeculativeConfig, runs: dict[str, ServerRun], plain: dict[str, ServerRun] | None
) -> list[EngineResult]:
    rows = []
    for file, run in runs.items():
        reference = plain[file] if plain is not None else None
        rows.append(
            EngineResult(
                file=file,
                drafter=drafter,
                setting=setting.label,
                acceptance=engine_acceptance(run.completions),
                matches_greedy=matching_outputs(run.completions, reference.completions) if reference else None,
                tokens_per_s=run.tokens_per_s,
                plain_tokens_per_s=reference.tokens_per_s if reference else None,
                concurrent_tokens_per_s=run.concurrent_tokens_per_s,
                plain_concurrent_tokens_per_s=reference.concurrent_tokens_per_s if reference else None,
                first_token_ms=run.first_token_ms,
                plain_first_token_ms=reference.first_token_ms if reference else None,
                plain_new_tokens=sum(len(c.output_ids) for c in reference.completions) if reference else None,
                request_fixed_ms=run.request_fixed_ms(),
                plain_request_fixed_ms=reference.request_fixed_ms() if reference else None,
            )
        )
    return rows


def _compare_with_own(
    results: list[EngineResult],
    drafters: dict[str, "Eagle3Drafter"],
    prompt_sets: dict[str, list[list[int]]],
    target: Path,
    headline: SpeculativeConfig,
    max_new_tokens: int,
    on_measured: Callable[[], None] = lambda: None,
) -> None:
    """The project's own speculative decoding of the same prompts, once per drafter and file, at the headline
    setting when it is a chain (a Python loop of one prompt at a time: minutes on a GPU, so not for a whole sweep)."""
    if not headline.chain:
        return
    import torch

    from services.trainer.evaluate import load_target
    from services.trainer.speculative import measure_acceptance

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target_model = load_target(target).to(device)
    for name, drafter in drafters.items():
        drafter.to(device)
        for file, prompts in prompt_sets.items():
            rows = [r for r in results if (r.drafter, r.file, r.setting) == (name, file, headline.label)]
            if rows and all(r.own_acceptance_length is not None for r in rows):
                continue  # measured before this evaluation was resumed
            # SGLang's plain server gives the comparison with greedy decoding; ours only needs the acceptance.
            own = measure_acceptance(
                target_model,
                drafter,
                prompts,
                num_draft_tokens=headline.steps,
                max_new_tokens=max_new_tokens,
                check_greedy=False,
            ).mean_acceptance_length
            for result in rows:
                result.compare_with_own(own)
            on_measured()


def best_setting(results: list[EngineResult]) -> dict[str, Any] | None:
    """The setting with the highest median batch-1 speedup of the trained (or served) drafter over the files."""
    by_setting: dict[str, list[float]] = {}
    for result in results:
        if result.drafter in ("trained", "served") and result.speedup is not None:
            by_setting.setdefault(result.setting, []).append(result.speedup)
    if not by_setting:
        return None
    setting, speedups = max(by_setting.items(), key=lambda item: statistics.median(item[1]))
    return {"setting": setting, "median_speedup": statistics.median(speedups)}


def server_info(url: str) -> dict[str, Any]:
    for path in ("/server_info", "/get_server_info"):
        response = httpx.get(f"{url}{path}", timeout=30)
        if response.status_code == 200:
            return response.json()
    raise Eagle3Error(f"{url}: neither /server_info nor /get_server_info answered")


# ----------------------------------------------------------------------------------------------------------
# The table


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _pair(ours: float | None, plain: float | None, form: str) -> str:
    """This server's figure, then plain's (a dash where a report written before the figure was kept has none)."""
    return " / ".join("-" if value is None else form.format(value) for value in (ours, plain))


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def engine_table(report: dict[str, Any]) -> Table:
    """`eagle3 eval`'s table with the engine's columns: a row per file, drafter and speculative setting."""
    concurrency = report["concurrency"]
    step = "" if report["step"] is None else f" (step {report['step']})"
    table = Table(
        title=f"SGLang EAGLE-3: {report['checkpoint']}{step}, greedy, up to "
        f"{report['max_new_tokens']} new tokens per prompt; tokens/s medians of {report['repeats']} runs",
        caption="setting = steps,topk,draft tokens; ours = the project's own measured acceptance, same prompts; "
        "break-even = the acceptance length at which the setting's step decodes as fast as plain at batch 1 (x1.5 "
        "for 1.5x); first token and step = batch-1 milliseconds of a one-token request and of a step after it, fixed = "
        f"what a batch-1 request costs besides its steps (from {SHORT_REQUEST_TOKENS}-token and full requests), this "
        "server / plain",
    )
    for column in ("prompts file", "drafter", "setting"):
        table.add_column(column, overflow="fold")
    for column in ("prompts", "new tokens", "accept length", "95% interval", "ours"):
        table.add_column(column, justify="right")
    table.add_column("acceptance per draft position")
    table.add_column("matches greedy", justify="right")
    columns = ("tok/s b1", "plain b1", "speedup b1", "break-even", "first token ms", "fixed ms", "step ms")
    for column in (*columns, f"tok/s @{concurrency}", f"plain @{concurrency}"):
        table.add_column(column, justify="right")
    table.add_column(f"speedup @{concurrency}", justify="right")
    files = {row["file"] for row in report["results"]}
    short_names = len({Path(file).name for file in files}) == len(files)
    for row in report["results"]:
        acceptance = row["acceptance"]
        low, high = acceptance["acceptance_length_ci95"]
        own = row["own_acceptance_length"]
        table.add_row(
            Path(row["file"]).name if short_names else row["file"],
            row["drafter"],
            row["setting"],
            str(acceptance["prompts"]),
            str(acceptance["new_tokens"]),
            f"{acceptance['acceptance_length']:.3f}",
            f"{low:.3f}-{high:.3f}",
            "-" if own is None else f"{own:.3f}",
            " ".join(f"{share:.2f}" for share in acceptance["position_acceptance"]) or "-",
            "-" if row["matches_greedy"] is None else f"{row['matches_greedy']}/{acceptance['prompts']}",
            _rate(row["tokens_per_s"]),
            _rate(row["plain_tokens_per_s"]),
            _ratio(row["speedup"]),
            "-" if row.get("break_even_acceptance") is None else f"{row['break_even_acceptance']:.2f}",
            _pair(row.get("first_token_ms"), row.get("plain_first_token_ms"), "{:.0f}"),
            _pair(row.get("request_fixed_ms"), row.get("plain_request_fixed_ms"), "{:.0f}"),
            _pair(row.get("step_ms"), row.get("plain_token_ms"), "{:.2f}"),
            _rate(row["concurrent_tokens_per_s"]),
            _rate(row["plain_concurrent_tokens_per_s"]),
            _ratio(row["concurrent_speedup"]),
        )
    return table


# ----------------------------------------------------------------------------------------------------------
# `eagle3 eval --engine sglang`


def add_engine_arguments(eval_parser: argparse.ArgumentParser) -> None:
    """The serving-engine options of `eagle3 eval`; its own options (--checkpoint, --prompts-file, --baseline,
    --max-prompts, --max-new-tokens, --num-draft-tokens, --json, --model) mean the same with --engine sglang."""
    group = eval_parser.add_argument_group("serving engine (--engine sglang, with --prompts-file)")
    group.add_argument(
        "--engine",
        choices=["ours", "sglang"],
        default="ours",
        help="ours: the project's own speculative decoding (default); sglang: SGLang's EAGLE-3 serving, CUDA graphs "
        "on, against plain SGLang decoding",
    )
    group.add_argument(
        "--speculative",
        action="append",
        type=speculative_setting,
        metavar="STEPS,TOPK,DRAFT_TOKENS",
        help="a serving setting; repeat to sweep (the report names the fastest; --baseline's untrained drafter is "
        "served at the first only). Default: a chain of --num-draft-tokens drafts, N,1,N+1",
    )
    group.add_argument("--concurrency", type=int, default=16, help="requests in flight for the loaded speedup")
    group.add_argument("--repeats", type=int, default=2, help="timed runs per measure (medians)")
    group.add_argument(
        "--drafter",
        type=Path,
        metavar="DIR",
        help="instead of --checkpoint: an EAGLE-3 draft folder SGLang serves (an export, ours or another trainer's), "
        "around the target given with --model",
    )
    group.add_argument("--url", help="a running SGLang server that serves the drafter (its settings are read)")
    group.add_argument("--plain-url", help="a running plain SGLang server of the same target")
    group.add_argument("--sglang-python", default=sys.executable, help="the Python that has SGLang (default: this)")
    group.add_argument(
        "--sglang-args", default="", help="more sglang.launch_server arguments for every launch (one string)"
    )
    group.add_argument(
        "--no-own-eval",
        dest="compare_own",
        action="store_false",
        help="skip the project's own measured acceptance beside SGLang's",
    )
    group.add_argument("--work-dir", type=Path, help="keep the exports and server logs here (default: temporary)")
    group.add_argument(
        "--resume",
        action="store_true",
        help="go on from what an earlier run with the same --work-dir measured (same drafters, prompts, settings)",
    )
    eval_parser.set_defaults(func=cmd_eval)


def speculative_setting(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.parse(text)
    except ConfigurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def cmd_eval(args: argparse.Namespace, settings: Settings) -> None:
    from services.trainer import cli as trainer_cli

    if args.engine == "ours":
        if args.drafter is not None:
            raise ConfigurationError("--drafter is served by SGLang: it needs --engine sglang")
        trainer_cli.cmd_eval(args, settings)
        return
    if not args.prompts_file:
        raise ConfigurationError("--engine sglang decodes prompt files: give --prompts-file")
    if args.concurrency < 1 or args.repeats < 1:
        raise ConfigurationError("--concurrency and --repeats must be at least 1")
    steps = args.num_draft_tokens
    options = EngineEvalOptions(
        settings=args.speculative or [SpeculativeConfig(steps, 1, steps + 1)],
        max_new_tokens=args.max_new_tokens,
        concurrency=args.concurrency,
        repeats=args.repeats,
        max_prompts=args.max_prompts,
        compare_own=args.compare_own,
        url=args.url,
        plain_url=args.plain_url,
        sglang_python=args.sglang_python,
        sglang_args=shlex.split(args.sglang_args),
        work_dir=args.work_dir,
        resume=args.resume,
    )
    if args.resume and args.work_dir is None:
        raise ConfigurationError("--resume goes on from --work-dir: give the folder of the earlier run")
    if (args.checkpoint is None) == (args.drafter is None):
        raise ConfigurationError("--engine sglang serves a --checkpoint or a --drafter folder: give one of the two")
    if args.drafter is not None:
        source = drafters_from_folder(args.drafter, model_path=args.model_path, baseline=args.baseline)
    else:
        source = drafters_from_checkpoint(
            args.checkpoint, settings=settings, model_path=args.model_path, baseline=args.baseline
        )
    report = evaluate_on_engine(source, [Path(file) for file in args.prompts_file], options=options)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print_engine_report(report, Console())


def print_engine_report(report: dict[str, Any], console: Console) -> None:
    """The table, what it could not say in a cell, and the fastest setting."""
    console.print(engine_table(report))
    for row in report["results"]:
        for note in row["notes"]:
            console.print(f"[yellow]{Path(row['file']).name}, {row['drafter']}, {row['setting']}: {note}[/]")
    for refused in report.get("refused", []):  # reports written before it was kept have none
        reason = refused["reason"].splitlines()[-1] if refused["reason"] else ""
        console.print(f"[yellow]{refused['drafter']}, {refused['setting']}: SGLang did not serve it ({reason})[/]")
    if report["best_setting"]:
        best = report["best_setting"]
        console.print(f"fastest setting at batch 1: {best['setting']} ({best['median_speedup']:.2f}x plain, median)")
