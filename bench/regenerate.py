"""Regeneration efficiency: generated tokens/s end to end (producer, Redis, Celery workers, storage, the reference
server's batched decoding) against the reference server's own decoding tokens/s when driven directly at the same
concurrency with the same prompts. Same server, same process, alternating runs; prints medians and the ratio.

The direct runs send every assistant turn's prompt of the pipeline's output (each regenerated history rendered
with the chat template), longest first (the reference server batches statically, and similar lengths pad least),
greedy with the same max_new_tokens, so both sides generate the same tokens; the pipeline additionally decodes the
turns of a conversation one after another and renders each prompt on the way.

    python -m bench.regenerate [--conversations 24] [--workers 2] [--concurrency 4] [--max-new-tokens 32]
"""

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import redis
from rich.console import Console
from rich.table import Table

from eagle3.local_stack import LocalStack
from shared.capture.client import InferenceClient
from shared.data.datasets import Conversation, Message
from shared.data.demo_data import write_demo_dataset
from shared.data.model_assets import resolve_model_path
from shared.data.tokenization import ChatTokenizer
from shared.lifecycle import progress
from shared.settings import Settings
from shared.storage import layout
from shared.storage.objects import open_storage


def turn_prompts(output: list[dict], tokenizer: ChatTokenizer) -> list[list[int]]:
    """The prompt of every assistant turn of the regenerated conversations, as the workers rendered them."""
    prompts = []
    for record in output:
        history: list[Message] = []
        conv = Conversation(sample_id=record["id"], line=0)
        for message in record["messages"]:
            if message["role"] == "assistant":
                prompts.append(tokenizer.generation_prompt(conv, history))
            history.append(Message(message["role"], message["content"]))
    return prompts


def direct_rate(url: str, prompts: list[list[int]], max_new_tokens: int, concurrency: int) -> tuple[float, int]:
    """(generated tokens/s, generated tokens) with `concurrency` requests in flight."""
    with InferenceClient(url, timeout_s=3600, max_concurrency=concurrency) as client:

        def one(prompt: list[int]) -> int:
            answer = client.generate(
                input_ids=prompt, sampling_params={"max_new_tokens": max_new_tokens, "temperature": 0}
            )
            assert isinstance(answer, dict)
            return answer["meta_info"]["completion_tokens"]

        started = time.monotonic()
        with ThreadPoolExecutor(concurrency) as pool:
            generated = sum(pool.map(one, prompts))
        return generated / (time.monotonic() - started), generated


def pipeline_rate(
    stack: LocalStack, settings: Settings, dataset: Path, model: Path, args: argparse.Namespace
) -> tuple[float, int, list[dict]]:
    """(generated tokens/s from submit to the assembled dataset, generated tokens, the output)."""
    client = redis.Redis.from_url(settings.redis_url)
    started = time.monotonic()
    with stack.api_client() as api:
        response = api.post(
            "/v1/jobs",
            json={
                "dataset_url": str(dataset),
                "model_path": str(model),
                "kind": "regenerate",
                "max_new_tokens": args.max_new_tokens,
                "conversations_per_shard": args.conversations_per_shard,
            },
        )
    job = response.json()["job"]
    while not (p := progress.job_progress(client, job["job_id"])).finished:
        stack.check_alive()
        time.sleep(0.1)
    wall = time.monotonic() - started
    assert p.state == "completed", p
    storage = open_storage(settings.storage_url, settings)
    output = [json.loads(line) for line in storage.get(layout.regenerated_dataset(job["job_id"])).splitlines()]
    return p.tokens_done / wall, p.tokens_done, output


def decode_batches(url: str) -> tuple[float, float]:
    """(generate calls, prompts) the server decoded so far."""
    values = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("eagle3_inference_decode_batch_prompts_"):
            name, value = line.split(" ")
            values[name] = float(value)
    return values["eagle3_inference_decode_batch_prompts_count"], values["eagle3_inference_decode_batch_prompts_sum"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=4, help="EAGLE3_REGENERATE_CONCURRENCY per worker")
    parser.add_argument("--conversations-per-shard", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="smollm2")
    args = parser.parse_args()
    console = Console()

    model = resolve_model_path(args.model)
    work = Path(tempfile.mkdtemp(prefix="eagle3-bench-regenerate-"))
    dataset = write_demo_dataset(work / "data.jsonl", num_conversations=args.conversations)
    tokenizer = ChatTokenizer.from_pretrained(model)
    concurrency = args.workers * args.concurrency
    settings = Settings(
        storage_url=(work / "storage").as_uri(),
        model_path=model,
        dataset_roots=[str(work)],
        home=work,
        regenerate_concurrency=args.concurrency,
        redis_url="redis://127.0.0.1:6379/15",
    )
    direct, pipeline, tokens, batch_sizes, direct_batch_sizes = [], [], [], [], []
    with LocalStack(settings, workers=args.workers, log_dir=work / "logs", pick_free_ports=True) as stack:
        url = stack.env["EAGLE3_INFERENCE_URL"]
        warm = [tokenizer.generation_prompt(Conversation("w", 0), [Message("user", "Hello")])] * concurrency
        direct_rate(url, warm, 8, concurrency)  # warm-up
        for repeat in range(args.repeats):
            calls, prompts = decode_batches(url)
            rate, generated, output = pipeline_rate(stack, settings, dataset, model, args)
            calls_after, prompts_after = decode_batches(url)
            pipeline.append(rate)
            batch_sizes.append((prompts_after - prompts) / max(calls_after - calls, 1))
            # Longest first: requests of similar length arrive together, the static batches pad least.
            prompts = sorted(turn_prompts(output, tokenizer), key=len, reverse=True)
            direct_rate_, direct_generated = direct_rate(url, prompts, args.max_new_tokens, concurrency)
            calls_direct, prompts_direct = decode_batches(url)
            direct.append(direct_rate_)
            direct_batch_sizes.append((prompts_direct - prompts_after) / max(calls_direct - calls_after, 1))
            tokens.append((generated, direct_generated))
            console.print(
                f"run {repeat + 1}: pipeline {rate:.1f} generated tok/s ({generated} tokens, "
                f"{batch_sizes[-1]:.1f} prompts per generate call), direct {direct_rate_:.1f} tok/s "
                f"({direct_generated} tokens, {direct_batch_sizes[-1]:.1f} prompts per generate call)"
            )

    table = Table(
        title=f"{model.name}, {args.conversations} conversations, max_new_tokens {args.max_new_tokens}, greedy, "
        f"{args.workers} workers x {args.concurrency} conversations in flight (medians of {args.repeats})"
    )
    for column in ("measure", "generated tokens/s", "ratio to direct"):
        table.add_column(column)
    base = statistics.median(direct)
    table.add_row(f"reference server driven directly ({concurrency} in flight)", f"{base:.1f}", "1.00")
    table.add_row(
        "pipeline, submit to assembled dataset",
        f"{statistics.median(pipeline):.1f}",
        f"{statistics.median(pipeline) / base:.2f}",
    )
    console.print(table)
    console.print(
        f"generated tokens per run (pipeline, direct): {tokens}; "
        f"prompts per generate call: pipeline {statistics.median(batch_sizes):.1f}, "
        f"direct {statistics.median(direct_batch_sizes):.1f} (medians)"
    )


if __name__ == "__main__":
    main()
