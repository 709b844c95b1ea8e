"""Pipeline efficiency: extraction tokens/s through producer, Redis, Celery workers and storage, against the
reference server's own tokens/s when driven directly at the same concurrency. Same server, same process,
alternating runs; prints medians and the ratio (target: >= 0.9).

    python -m bench.pipeline [--conversations 200] [--workers 2] [--repeats 3]
"""

import argparse
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path

import redis
from rich.console import Console
from rich.table import Table

from eagle3.local_stack import LocalStack
from shared.capture.client import InferenceClient
from shared.capture.protocol import default_aux_layer_ids
from shared.data.datasets import Conversation, read_dataset
from shared.data.demo_data import write_demo_dataset
from shared.data.model_assets import resolve_model_path
from shared.data.tokenization import ChatTokenizer
from shared.lifecycle import progress
from shared.lifecycle.schemas import Manifest
from shared.settings import Settings
from shared.storage import layout
from shared.storage.objects import open_storage


def direct_rate(url: str, prompts: list[list[int]], aux_layer_ids: list[int], concurrency: int) -> float:
    with InferenceClient(
        url, timeout_s=600, max_concurrency=concurrency, transport="body", shm_dir=Path("/tmp")
    ) as client:
        started = time.monotonic()
        requests = [(f"bench/{i}/{time.monotonic_ns()}", ids) for i, ids in enumerate(prompts)]
        for _ in client.capture_many(requests, aux_layer_ids):
            pass
        return sum(map(len, prompts)) / (time.monotonic() - started)


def pipeline_rate(stack: LocalStack, settings: Settings, dataset: Path, model: Path) -> tuple[float, float]:
    """(tokens/s from the first shard's start to the last commit, tokens/s from submit to completion)."""
    client = redis.Redis.from_url(settings.redis_url)
    started = time.monotonic()
    with stack.api_client() as api:
        job = api.post("/v1/jobs", json={"dataset_url": str(dataset), "model_path": str(model)}).json()["job"]
    while not (p := progress.job_progress(client, job["job_id"])).finished:
        stack.check_alive()
        time.sleep(0.2)
    wall = time.monotonic() - started
    assert p.state == "completed", p
    storage = open_storage(settings.storage_url, settings)
    manifests = [
        Manifest.model_validate_json(storage.get(k)) for k in storage.list(layout.manifests_prefix(job["job_id"]))
    ]
    first = min(datetime.fromisoformat(m.started_at) for m in manifests)
    last = max(datetime.fromisoformat(m.committed_at) for m in manifests)
    return p.tokens_done / (last - first).total_seconds(), p.tokens_done / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--inference-concurrency", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    console = Console()

    model = resolve_model_path("smollm2")
    work = Path(tempfile.mkdtemp(prefix="eagle3-bench-"))
    dataset = write_demo_dataset(work / "data.jsonl", num_conversations=args.conversations)
    tokenizer = ChatTokenizer.from_pretrained(model)
    prompts = [
        tokenizer.tokenize(c, max_length=2048, length_policy="truncate").input_ids
        for c in read_dataset(dataset.read_text().splitlines())
        if isinstance(c, Conversation)
    ]
    aux_layer_ids = default_aux_layer_ids(30)
    settings = Settings(
        storage_url=(work / "storage").as_uri(),
        model_path=model,
        dataset_roots=[str(work)],
        home=work,
        inference_concurrency=args.inference_concurrency,
        redis_url="redis://127.0.0.1:6379/15",
    )
    concurrency = args.workers * args.inference_concurrency
    direct, window, wall = [], [], []
    with LocalStack(settings, workers=args.workers, log_dir=work / "logs", pick_free_ports=True) as stack:
        url = stack.env["EAGLE3_INFERENCE_URL"]
        direct_rate(url, prompts[:16], aux_layer_ids, concurrency)  # warm-up
        for repeat in range(args.repeats):
            direct.append(direct_rate(url, prompts, aux_layer_ids, concurrency))
            w, e = pipeline_rate(stack, settings, dataset, model)
            window.append(w)
            wall.append(e)
            console.print(
                f"run {repeat + 1}: direct {direct[-1]:.0f} tok/s, pipeline {w:.0f} tok/s "
                f"(submit to completion {e:.0f} tok/s)"
            )

    table = Table(
        title=f"SmolLM2-135M, {len(prompts)} conversations, {sum(map(len, prompts))} tokens, "
        f"{args.workers} workers x {args.inference_concurrency} in flight (medians of {args.repeats})"
    )
    for column in ("measure", "tokens/s", "ratio to direct", "target"):
        table.add_column(column)
    base = statistics.median(direct)
    table.add_row("reference server driven directly", f"{base:.0f}", "1.00", "")
    table.add_row(
        "pipeline, first shard start to last commit",
        f"{statistics.median(window):.0f}",
        f"{statistics.median(window) / base:.2f}",
        ">= 0.90",
    )
    table.add_row(
        "pipeline, submit to completion (incl. tokenization)",
        f"{statistics.median(wall):.0f}",
        f"{statistics.median(wall) / base:.2f}",
        "",
    )
    console.print(table)


if __name__ == "__main__":
    main()
