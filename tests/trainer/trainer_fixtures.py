"""Session fixture `extracted_job`: a job extracted for real by the reference server, for training tests."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from shared.capture.client import InferenceClient
from shared.lifecycle import shards
from shared.lifecycle.kind import ShardContext
from shared.lifecycle.kinds import EXTRACT
from shared.settings import Settings
from shared.storage.objects import open_storage
from tests.fixtures.reference_server import run_reference_server
from tests.trainer.shard_builders import ExtractedJob, plan_job, sharpen_target


@pytest.fixture(scope="session")
def extracted_job(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, redis_server: str
) -> Iterator[ExtractedJob]:
    """A job of ~50 samples in ~10 shards, every shard extracted by the reference server from the tiny model with a
    sharpened head (see `sharpen_target`)."""
    yield from extract_job(tmp_path_factory.mktemp("trainer-job"), tiny_model_dir, redis_server, job_id="trainer")


@pytest.fixture(scope="session")
def extracted_fp8_job(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, redis_server: str
) -> Iterator[ExtractedJob]:
    """The same job, stored as fp8 (e4m3, per-token scales)."""
    root = tmp_path_factory.mktemp("trainer-fp8-job")
    yield from extract_job(root, tiny_model_dir, redis_server, job_id="trainer-fp8", storage_dtype="fp8_e4m3")


def extract_job(root: Path, tiny_model_dir: Path, redis_server: str, **spec: object) -> Iterator[ExtractedJob]:
    model_dir = sharpen_target(tiny_model_dir, root / "model")
    storage = open_storage((root / "store").as_uri())
    job = plan_job(root, model_dir, redis_server, storage, repeat=3, shard_token_budget=300, **spec)
    client = redis.Redis.from_url(redis_server)
    # One thread: on a shared 2-core machine, OpenMP threads of a busy process spin and make small ops 40x slower.
    with (
        run_reference_server(model_dir, shm_dir=root, env={"OMP_NUM_THREADS": "1"}) as url,
        InferenceClient(url, timeout_s=60, max_concurrency=2, transport="body", shm_dir=root) as inference,
    ):
        ctx = ShardContext(storage, client, Settings(), worker="test", states={"extract": inference})
        for shard_index in range(job.shards_total):
            shards.run_shard(EXTRACT, job.job_id, shard_index, ctx)
    yield ExtractedJob(job=job, storage_url=storage.url, model_dir=model_dir)
