"""Committed shards for trainer tests: planned jobs, shards committed through the same storage and Redis calls
the worker makes (with random hidden states, for data tests), and a target for jobs extracted for real through
the reference server (`tests.trainer.trainer_fixtures.extracted_job`, for training tests)."""

import shutil
from dataclasses import dataclass
from pathlib import Path

import redis
import torch
from torch import nn

from shared.lifecycle import jobs, progress
from shared.lifecycle.kinds.extract import describe_sample
from shared.lifecycle.schemas import DeadLetter, JobRecord, JobSpec, Manifest, utc_now
from shared.settings import Settings
from shared.storage import layout
from shared.storage.objects import Storage
from shared.storage.sample_format import encode_sample
from tests.datasets import write_dataset


def plan_job(
    tmp_path: Path, model_dir: Path, redis_url: str, storage: Storage, *, repeat: int = 1, **spec: object
) -> JobRecord:
    """Tokenize and plan a job (job.json, shard inputs, vocab mapping) without enqueueing anything."""
    dataset, _ = write_dataset(tmp_path / f"data-{repeat}.jsonl", with_bad_lines=False, repeat=repeat)
    settings = Settings(
        redis_url=redis_url, storage_url=storage.url, dataset_roots=[str(tmp_path)], model_roots=[model_dir.parent]
    )
    return jobs.submit(
        JobSpec(dataset_url=str(dataset), model_path=str(model_dir), **spec),
        settings=settings,
        storage=storage,
        client=redis.Redis.from_url(redis_url),
        enqueue=lambda kind, job_id, shard: None,
    )


def commit_random_shard(storage: Storage, client: redis.Redis, job: JobRecord, shard_index: int) -> Manifest:
    """Commit a shard as a worker does (samples, then the manifest create-only, then count + event), with random
    hidden states instead of a forward pass."""
    shard = jobs.load_shard_input(storage, job, shard_index)
    generator = torch.Generator().manual_seed(shard_index)
    entries = []
    for sample in shard.samples:
        length, width = len(sample.input_ids), job.hidden_size
        aux = torch.randn(length, 3 * width, generator=generator).to(torch.bfloat16)
        hidden = torch.randn(length, width, generator=generator).to(torch.bfloat16)
        data = encode_sample(sample.input_ids, sample.loss_mask, aux, hidden)
        key = layout.sample(job.job_id, sample.sample_index)
        storage.put_if_absent(key, data)
        entries.append(describe_sample(sample, key, data))
    manifest = Manifest.of(job, shard_index, entries, worker="test", started_at=utc_now(), committed_at=utc_now())
    storage.put_if_absent(layout.manifest(job.job_id, shard_index), manifest.model_dump_json().encode())
    progress.record_commit(client, manifest)
    return manifest


def dead_letter_shard(storage: Storage, client: redis.Redis, job: JobRecord, shard_index: int) -> None:
    shard = jobs.load_shard_input(storage, job, shard_index)
    letter = DeadLetter(
        job_id=job.job_id, shard_index=shard_index, error_type="Test", reason="given up", retries=3, worker="test"
    )
    storage.put(layout.dead_letter(job.job_id, shard_index), letter.model_dump_json().encode())
    progress.record_dead_letter(client, letter, num_samples=len(shard.samples), num_tokens=shard.num_tokens)


@dataclass(frozen=True)
class ExtractedJob:
    job: JobRecord
    storage_url: str
    model_dir: Path

    @property
    def job_id(self) -> str:
        return self.job.job_id


def sharpen_target(model_dir: Path, out_dir: Path, *, head_std: float = 0.6) -> Path:
    """The tiny model with its own random lm_head (std head_std) instead of the tied embedding.

    The tiny model's tied head gives a near-uniform next-token distribution (entropy ~ ln V) whose argmax copies the
    input token, so a drafter's loss could hardly move and acceptance would be trivial. A separate, larger head makes
    the target's greedy choice a non-trivial function of the context (entropy ~1.5 nats here).
    """
    from transformers import LlamaForCausalLM

    shutil.copytree(model_dir, out_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model.config.tie_word_embeddings = False
    generator = torch.Generator().manual_seed(1)
    head = torch.randn(model.lm_head.weight.shape, generator=generator) * head_std
    model.lm_head.weight = nn.Parameter(head.to(torch.bfloat16))
    model.save_pretrained(out_dir)
    return out_dir
