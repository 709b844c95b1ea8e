"""A deployment for end-to-end tests: the stack as local processes (redis-server, the reference inference server,
Celery workers, the producer API) over a SeaweedFS S3 bucket, and what a test asks of it."""

import json
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis

from eagle3.local_stack import LocalStack
from shared.lifecycle import progress
from shared.lifecycle.schemas import Manifest, Progress
from shared.settings import Settings
from shared.storage import layout
from shared.storage.objects import Storage, open_storage


class Deployment:
    def __init__(self, stack: LocalStack, settings: Settings, storage: Storage) -> None:
        self.stack, self.settings, self.storage = stack, settings, storage
        self.redis = redis.Redis.from_url(settings.redis_url)
        self.api = stack.api_client(timeout_s=120)

    def submit(self, dataset: Path, **spec: object) -> dict:
        response = self.api.post("/v1/jobs", json={"dataset_url": str(dataset), **spec})
        assert response.status_code == 201, response.text
        return response.json()["job"]

    def wait(self, job_id: str, timeout_s: float = 180) -> Progress:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            p = progress.job_progress(self.redis, job_id)
            if p.finished:
                return p
            self.stack.check_alive()
            time.sleep(0.3)
        raise TimeoutError(f"job {job_id} not finished: {progress.job_progress(self.redis, job_id)}")

    def manifests(self, job_id: str) -> list[Manifest]:
        keys = self.storage.list(layout.manifests_prefix(job_id))
        return [Manifest.model_validate_json(self.storage.get(k)) for k in keys]

    def output(self, job_id: str) -> list[dict]:
        """A regenerate job's assembled dataset."""
        return [json.loads(line) for line in self.storage.get(layout.regenerated_dataset(job_id)).splitlines()]


@contextmanager
def deploy(
    s3_server: Any, redis_url: str, model_dir: Path, home: Path, *, workers: int = 2, **settings: Any
) -> Iterator[Deployment]:
    """The stack with short retry and shutdown settings (tests wait for them), on its own prefix of the bucket."""
    config = Settings(
        redis_url=redis_url,
        storage_url=f"s3://{s3_server.bucket}/e2e-{uuid.uuid4().hex[:8]}",
        s3_endpoint_url=s3_server.endpoint_url,
        model_path=model_dir,
        dataset_roots=[str(home.parent)],  # pytest's base temp (home is one of its folders): every test's tmp_path
        home=home,
        task_max_retries=1,
        retry_backoff_max_s=1,
        redelivery_sweep_s=1,
        inference_ready_timeout_s=2,
        soft_shutdown_timeout_s=2,
        **settings,
    )
    with pytest.MonkeyPatch.context() as mp:
        for name, value in s3_server.env().items():
            if name.startswith("AWS_"):  # credentials for boto3 here and in every child process
                mp.setenv(name, value)
        with LocalStack(config, workers=workers, log_dir=home / "logs", pick_free_ports=True) as stack:
            yield Deployment(stack, config, open_storage(config.storage_url, config))
