"""One real stack for the operator tests (package scope): redis-server, the reference inference server with a tiny
Llama, two Celery workers and the producer API as processes, file storage; plus jobs that ran on it for real:
a clean one (with rejected lines, and a trainer run that follows it) and one planned for another model, whose
every shard is dead-lettered by the workers' model check."""

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from eagle3.local_stack import LocalStack
from shared.settings import Settings
from tests.builders import build_tiny_llama
from tests.datasets import write_dataset

# The operator's stall limit (EAGLE3_STALL_AFTER_S) for this stack: short, so that a stall shows within a test.
# The production default is checked in tests/integration/test_cluster.py by moving the clock instead.
STALL_AFTER_S = 4.0
REDIS_DB = 7  # not db 0, which other tests flush between tests


@dataclass
class OpsStack:
    stack: LocalStack
    settings: Settings
    api: httpx.Client
    redis: redis.Redis
    model_dir: Path
    other_model_dir: Path  # a different tiny Llama (hidden size 32): jobs planned for it are dead-lettered
    dataset: Path

    def submit(self, dataset: Path, **spec: object) -> str:
        response = self.api.post("/v1/jobs", json={"dataset_url": str(dataset), **spec})
        assert response.status_code == 201, response.text
        return response.json()["job"]["job_id"]

    def wait_finished(self, job_id: str, timeout_s: float = 180) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            p = self.api.get(f"/v1/jobs/{job_id}").json()["progress"]
            if p["state"] in ("completed", "completed_with_errors", "cancelled"):
                return p
            self.stack.check_alive()
            time.sleep(0.3)
        raise TimeoutError(f"job {job_id} not finished after {timeout_s}s")

    def process_groups(self, prefix: str) -> list[int]:
        return [p.pid for name, p in self.stack.processes if name.startswith(prefix)]

    def pause(self, prefix: str) -> None:
        for pgid in self.process_groups(prefix):
            os.killpg(pgid, signal.SIGSTOP)

    def resume(self, prefix: str) -> None:
        for pgid in self.process_groups(prefix):
            os.killpg(pgid, signal.SIGCONT)


@dataclass
class RanJobs:
    clean: str  # completed, with rejected lines and a trainer run
    dead: str  # completed_with_errors: every shard dead-lettered (model mismatch)


@pytest.fixture(scope="package")
def ops_stack(redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpsStack]:
    home = tmp_path_factory.mktemp("ops-home")
    model_dir = build_tiny_llama(home / "tiny-llama")
    other_model_dir = build_tiny_llama(home / "tiny-llama-32", hidden_size=32)
    dataset, _ = write_dataset(home / "data.jsonl")
    settings = Settings(
        redis_url=redis_server.rsplit("/", 1)[0] + f"/{REDIS_DB}",
        storage_url=(home / "storage").as_uri(),
        model_path=model_dir,
        home=home,
        inference_concurrency=2,
        stall_after_s=STALL_AFTER_S,
        storage_budget_bytes=10**9,  # per job: the dashboard shows each job's headroom
    )
    client = redis.Redis.from_url(settings.redis_url)
    client.flushdb()
    with LocalStack(settings, workers=2, log_dir=home / "logs", pick_free_ports=True) as stack:
        api = httpx.Client(base_url=stack.api_url, timeout=60)
        yield OpsStack(stack, settings, api, client, model_dir, other_model_dir, dataset)
        api.close()
    client.flushdb()


@pytest.fixture(scope="package")
def ran_jobs(ops_stack: OpsStack, tmp_path_factory: pytest.TempPathFactory) -> RanJobs:
    from services.trainer.train import TrainConfig, train

    clean = ops_stack.submit(ops_stack.dataset, shard_token_budget=200, draft_vocab_size=64)
    dead = ops_stack.submit(
        ops_stack.dataset, model_path=str(ops_stack.other_model_dir), shard_token_budget=400, draft_vocab_size=64
    )
    assert ops_stack.wait_finished(clean)["state"] == "completed"
    assert ops_stack.wait_finished(dead)["state"] == "completed_with_errors"
    # A trainer run that follows the clean job: its checkpoints and curves land under {job}/trainer/ops/.
    summary = train(
        TrainConfig(
            job_id=clean,
            run_name="ops",
            max_steps=2,
            checkpoint_every=1,
            log_every=1,
            heldout_fraction=0.0,
            batch_tokens=512,
            cache_dir=str(tmp_path_factory.mktemp("trainer-cache")),
            device="cpu",
        ),
        settings=ops_stack.settings,
    )
    assert summary["steps"] == 2
    return RanJobs(clean=clean, dead=dead)
