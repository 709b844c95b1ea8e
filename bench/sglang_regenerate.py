"""Regeneration through any inference server (SGLang here): a regenerate job's decoding, as the worker runs it,
against the server's own decoding driven directly at the same concurrency.

The job side is `shared.regeneration.regenerate_conversation` (chat template, each assistant turn decoded given
the regenerated history, sampling parameters and seed per turn, reasoning kept or dropped), `--concurrency`
conversations in flight, as one worker's shard. The direct side sends every assistant turn's prompt of that
output (the same token ids) with the same sampling parameters, `--concurrency` requests in flight, longest first.
Both count generated tokens (`completion_tokens`). Medians of alternating runs; greedy unless `--temperature`.
With two or more runs it also says whether every run regenerated the same conversations; with `--seed` and
`--temperature > 0` that is the job's promise (a reproducible sampled regeneration), and the exit status is 1 if
the runs differ (SGLang honours seeds only when launched with `--enable-deterministic-inference`).

    python -m bench.sglang_regenerate --url http://127.0.0.1:30000 --model-path /models/target \\
        --dataset chats.jsonl --conversations 64 --concurrency 16 --max-new-tokens 256

The server must keep its tokenizer for nothing here (prompts go as token ids, text is decoded here when the
server sends none), so the capture container's default `--skip-tokenizer-init` works too.
"""

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.common import bench_job
from shared.capture.client import InferenceClient
from shared.data.datasets import Conversation
from shared.data.tokenization import ChatTokenizer
from shared.lifecycle.kinds.regenerate import PromptRenderer, regenerate_conversation, sampling_params
from shared.lifecycle.schemas import ChatMessage, ConversationInput, ConversationResult, JobRecord, JobSpec


def read_conversations(path: Path, limit: int) -> list[ConversationInput]:
    """OpenAI-messages JSONL records ({"id", "messages"}) with at least one assistant turn."""
    conversations = []
    for line_number, line in enumerate(path.read_text().splitlines(), start=1):
        record = json.loads(line)
        messages = [ChatMessage(role=m["role"], content=m["content"]) for m in record["messages"]]
        if any(m.role == "assistant" for m in messages):
            sample_id = str(record.get("id", f"line-{line_number}"))
            conversations.append(
                ConversationInput(
                    sample_index=len(conversations), sample_id=sample_id, line=line_number, messages=messages
                )
            )
        if len(conversations) == limit:
            break
    return conversations


def regenerate_job(args: argparse.Namespace, info: Any, reasoning: str) -> JobRecord:
    spec = JobSpec(
        dataset_url="-",
        kind="regenerate",
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        reasoning=reasoning,
    )
    job = bench_job(
        hidden_size=info.hidden_size, num_hidden_layers=info.num_hidden_layers, vocab_size=info.vocab_size,
        aux_layer_ids=info.default_aux_layer_ids,
    )  # fmt: skip
    return job.model_copy(update={"job_id": "bench-regenerate", "spec": spec})


def job_run(
    client: InferenceClient,
    conversations: list[ConversationInput],
    job: JobRecord,
    renderer: PromptRenderer,
    max_context_length: int,
    concurrency: int,
) -> tuple[float, list[ConversationResult]]:
    """(seconds, results) of decoding every conversation as a worker's shard does, `concurrency` in flight."""

    def one(conv: ConversationInput) -> ConversationResult:
        return regenerate_conversation(
            conv, job=job, renderer=renderer, inference=client, max_context_length=max_context_length
        )

    # Most assistant turns first, as regenerate_shard orders them: the tail with few conversations left is short.
    ordered = sorted(conversations, key=lambda c: -sum(m.role == "assistant" for m in c.messages))
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, ordered))
    return time.perf_counter() - started, results


def turn_prompts(results: list[ConversationResult], renderer: PromptRenderer) -> list[list[int]]:
    """The prompt of every regenerated assistant turn, as the job rendered it."""
    prompts = []
    for result in results:
        assert result.messages is not None, result.error
        history: list[ChatMessage] = []
        for message in result.messages:
            if message.role == "assistant":
                prompts.append(renderer.prompt(Conversation(sample_id=result.sample_id, line=result.line), history))
            history.append(message)
    return prompts


def direct_run(
    client: InferenceClient, prompts: list[list[int]], params: dict[str, Any], concurrency: int
) -> tuple[float, int]:
    """(seconds, generated tokens) of the prompts decoded with plain `/generate` requests, `concurrency` in flight."""

    def one(prompt: list[int]) -> int:
        answer = client.generate(input_ids=prompt, sampling_params=params)
        assert isinstance(answer, dict), answer
        return int(answer["meta_info"]["completion_tokens"])

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        generated = sum(pool.map(one, sorted(prompts, key=len, reverse=True)))
    return time.perf_counter() - started, generated


def outcome(results: list[ConversationResult]) -> dict[str, int]:
    ok = [r for r in results if not r.failed]
    return {
        "conversations": len(results),
        "failed": len(results) - len(ok),
        "turns": sum(len(r.turns) for r in ok),
        "generated_tokens": sum(r.generated_tokens for r in ok),
        "truncated_turns": sum(t.truncated for r in ok for t in r.turns),
        "empty_turns": sum(t.empty for r in ok for t in r.turns),
        "turns_with_reasoning": sum(t.reasoning for r in ok for t in r.turns),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True)
    parser.add_argument("--model-path", type=Path, required=True, help="the served model's folder (its tokenizer)")
    parser.add_argument("--dataset", type=Path, required=True, help="OpenAI-messages JSONL")
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16, help="conversations (and direct requests) in flight")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--reasoning", choices=["keep", "drop"], default="keep")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    console = Console()

    conversations = read_conversations(args.dataset, args.conversations)
    renderer = PromptRenderer(ChatTokenizer.from_pretrained(args.model_path))
    with InferenceClient(args.url, timeout_s=3600, max_concurrency=args.concurrency) as client:
        client.wait_ready(600)
        info = client.model_info()
        job = regenerate_job(args, info, args.reasoning)
        params = sampling_params(job.spec)
        if args.seed is not None and args.temperature > 0:
            params["sampling_seed"] = args.seed
        job_rates, direct_rates, outcomes = [], [], []
        regenerated: list[dict[str, list[ChatMessage] | None]] = []  # each run's conversations by sample id
        job_run(client, conversations[: args.concurrency], job, renderer, info.max_context_length, args.concurrency)
        for r in range(args.repeats):
            seconds, results = job_run(client, conversations, job, renderer, info.max_context_length, args.concurrency)
            outcomes.append(outcome(results))
            regenerated.append({result.sample_id: result.messages for result in results})
            job_rates.append(outcomes[-1]["generated_tokens"] / seconds)
            direct_seconds, generated = direct_run(client, turn_prompts(results, renderer), params, args.concurrency)
            direct_rates.append(generated / direct_seconds)
            console.log(
                f"run {r + 1}: job {job_rates[-1]:.0f} generated tokens/s ({outcomes[-1]}), "
                f"direct {direct_rates[-1]:.0f} tokens/s ({generated} tokens)"
            )
        # The other reasoning policy once, to show it is honoured (counted, not timed).
        other = "drop" if args.reasoning == "keep" else "keep"
        _, other_results = job_run(
            client,
            conversations,
            regenerate_job(args, info, other),
            renderer,
            info.max_context_length,
            args.concurrency,
        )

    direct, job_rate = statistics.median(direct_rates), statistics.median(job_rates)
    identical = all(run == regenerated[0] for run in regenerated[1:]) if len(regenerated) > 1 else None
    seeded = args.seed is not None and args.temperature > 0
    table = Table(
        title=f"{info.model_path} on {info.backend} {info.sglang_version or info.version}: {len(conversations)} "
        f"conversations, max_new_tokens {args.max_new_tokens}, {json.dumps(params)}, {args.concurrency} in flight, "
        f"median of {args.repeats}"
    )
    for column in ("measure", "generated tokens/s", "ratio to direct"):
        table.add_column(column)
    table.add_row(f"{info.backend} decoding driven directly ({args.concurrency} in flight)", f"{direct:.0f}", "1.00")
    table.add_row(
        f"regenerate job's decoding (reasoning {args.reasoning})", f"{job_rate:.0f}", f"{job_rate / direct:.2f}"
    )
    console.print(table)
    console.print(f"job outcome (last run): {outcomes[-1]}; with reasoning {other}: {outcome(other_results)}")
    if identical is not None:
        verdict = "the same" if identical else "DIFFERENT"
        console.print(f"the {len(regenerated)} runs regenerated {verdict} conversations")
    if args.json:
        summary = {
            "url": args.url,
            "model": info.model_path,
            "backend": info.backend,
            "sglang_version": info.sglang_version,
            "sampling_params": params,
            "concurrency": args.concurrency,
            "conversations": len(conversations),
            "direct_tokens_s": direct,
            "job_tokens_s": job_rate,
            "direct_runs": direct_rates,
            "job_runs": job_rates,
            "outcomes": outcomes,
            f"outcome_reasoning_{other}": outcome(other_results),
            "runs_identical": identical,
        }
        args.json.write_text(json.dumps(summary, indent=2))
    if seeded and identical is False:
        sys.exit("a seeded sampled regeneration gave different conversations in two runs")


if __name__ == "__main__":
    main()
