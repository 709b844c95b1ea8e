"""bf16 against fp8 hidden-state storage, in one command: the same conversations extracted twice by the reference
server (once per `storage_dtype`), bytes per token of what was committed, then a drafter trained on each with the
same steps and seed, and its measured acceptance on two prompt files that training never saw (`eagle3 eval
--prompts-file`, with the untrained drafter as the baseline).

    python -m bench.storage_dtype --model smollm2 --conversations 200 --steps 300

Needs a redis-server binary (the extraction's progress counters); everything else runs in this process and one
reference-server process, on CPU or the GPU it finds.
"""

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
from rich.console import Console
from rich.table import Table

from bench.common import reference_server
from eagle3.local_stack import free_port
from services.trainer.config import TrainConfig
from services.trainer.evaluate import acceptance_table, evaluate_prompt_files
from services.trainer.train import train
from shared.capture.client import InferenceClient
from shared.data.demo_data import write_demo_dataset
from shared.data.model_assets import resolve_model_path
from shared.lifecycle import jobs, shards
from shared.lifecycle.kind import ShardContext
from shared.lifecycle.kinds import EXTRACT
from shared.lifecycle.schemas import JobSpec, Manifest
from shared.settings import Settings
from shared.storage import layout
from shared.storage.objects import open_storage

STORAGE_DTYPES = ("bfloat16", "fp8_e4m3")


def split_dataset(work: Path, conversations: int, held_out: int) -> tuple[Path, list[Path]]:
    """The training set, and two prompt files of held-out conversations (one per source corpus)."""
    everything = write_demo_dataset(work / "all.jsonl", num_conversations=conversations + held_out)
    lines = everything.read_text().splitlines(keepends=True)
    train_set = work / "train.jsonl"
    train_set.write_text("".join(lines[:conversations]))
    prompt_files = []
    for source in ("chatterbot", "chitchat"):
        path = work / f"heldout-{source}.jsonl"
        path.write_text("".join(line for line in lines[conversations:] if json.loads(line)["id"].startswith(source)))
        prompt_files.append(path)
    return train_set, prompt_files


def extract(
    job_id: str, storage_dtype: str, dataset: Path, model_dir: Path, settings: Settings, url: str, draft_vocab_size: int
) -> float:
    """Submit and extract one job in this process; its committed bytes per token."""
    storage = open_storage(settings.storage_url, settings)
    client = redis.Redis.from_url(str(settings.redis_url))
    spec = JobSpec(
        dataset_url=str(dataset),
        model_path=str(model_dir),
        job_id=job_id,
        storage_dtype=storage_dtype,
        draft_vocab_size=draft_vocab_size,
    )
    job = jobs.submit(spec, settings=settings, storage=storage, client=client, enqueue=lambda *task: None)
    with InferenceClient(url, timeout_s=600, max_concurrency=2, transport="body", shm_dir=settings.home) as inference:
        ctx = ShardContext(storage, client, settings, worker="bench", states={"extract": inference})
        for shard_index in range(job.shards_total):
            shards.run_shard(EXTRACT, job_id, shard_index, ctx)
    manifests = [Manifest.model_validate_json(storage.get(k)) for k in storage.list(layout.manifests_prefix(job_id))]
    samples = [sample for manifest in manifests for sample in manifest.samples]
    return sum(s.bytes for s in samples) / sum(s.num_tokens for s in samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="'smollm2' or a local Hugging Face folder")
    parser.add_argument("--conversations", type=int, default=200, help="training conversations")
    parser.add_argument("--held-out", type=int, default=40, help="conversations for the two prompt files")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps of each run")
    parser.add_argument("--batch-tokens", type=int, default=1024)
    parser.add_argument("--draft-vocab-size", type=int, default=2048, help="as the demo: a step CPUs can afford")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-prompts", type=int, default=12, help="prompts per file")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--json-out", type=Path, help="also write every number here")
    args = parser.parse_args()

    console = Console()
    model_dir = resolve_model_path(args.model)
    work = Path(tempfile.mkdtemp(prefix="bench-storage-dtype-"))
    redis_port = free_port()
    redis_server = subprocess.Popen(
        ["redis-server", "--port", str(redis_port), "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL
    )
    try:
        time.sleep(0.5)
        settings = Settings(
            storage_url=(work / "store").as_uri(),
            redis_url=f"redis://127.0.0.1:{redis_port}/0",
            home=work / "home",
            dataset_roots=[str(work)],
            model_roots=[model_dir.resolve().parent],
        )
        dataset, prompt_files = split_dataset(work, args.conversations, args.held_out)
        results: dict[str, dict[str, Any]] = {}
        with reference_server(model_dir, shm_dir=work, log=work / "server.log") as url:
            for storage_dtype in STORAGE_DTYPES:
                started = time.monotonic()
                bytes_per_token = extract(
                    f"bench-{storage_dtype}", storage_dtype, dataset, model_dir, settings, url, args.draft_vocab_size
                )
                results[storage_dtype] = {"bytes_per_token": bytes_per_token, "extract_s": time.monotonic() - started}
        for storage_dtype in STORAGE_DTYPES:
            config = TrainConfig(
                job_id=f"bench-{storage_dtype}",
                run_name="bench",
                max_steps=args.steps,
                schedule_steps=args.steps,
                epochs=1000,
                batch_tokens=args.batch_tokens,
                lr=args.lr,
                heldout_fraction=0.1,
                log_every=10,
                checkpoint_every=10**6,
                seed=0,
            )
            summary = train(config, settings=settings)
            report = evaluate_prompt_files(
                summary["checkpoint_key"],
                prompt_files,
                settings=settings,
                baseline=storage_dtype == "bfloat16",
                max_prompts=args.max_prompts,
                max_new_tokens=args.max_new_tokens,
            )
            console.print(acceptance_table(report))
            results[storage_dtype].update(
                final_loss=summary["final_loss"], train_seconds=summary["train_seconds"], acceptance=report["results"]
            )
    finally:
        redis_server.terminate()
        redis_server.wait(timeout=30)

    bf16, fp8 = results["bfloat16"], results["fp8_e4m3"]
    table = Table(title=f"bf16 vs fp8 storage: {args.model}, {args.conversations} conversations, {args.steps} steps")
    for column in ("storage dtype", "bytes/token", "ratio", "final loss", "prompts file", "accept length", "ratio"):
        table.add_column(column)
    for name, result in (("bfloat16", bf16), ("fp8_e4m3", fp8)):
        for trained, reference in zip(
            (r for r in result["acceptance"] if r["drafter"] == "trained"),
            (r for r in bf16["acceptance"] if r["drafter"] == "trained"),
            strict=True,
        ):
            table.add_row(
                name,
                f"{result['bytes_per_token']:.1f}",
                f"{result['bytes_per_token'] / bf16['bytes_per_token']:.3f}",
                f"{result['final_loss']:.4f}",
                Path(trained["file"]).name,
                f"{trained['acceptance_length']:.3f}",
                f"{trained['acceptance_length'] / reference['acceptance_length']:.3f}",
            )
    console.print(table)
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
