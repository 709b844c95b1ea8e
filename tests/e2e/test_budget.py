"""Storage budgets while jobs run, on the whole stack (Celery workers, reference server, SeaweedFS S3, the producer):
a job that reaches the budget pauses with the reason and goes on by itself, every sample committed exactly once,
after a delete makes room or after the budget is raised. EAGLE3_STORAGE_WAIT_S stays at its default (30 s)."""

import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from eagle3.retention import human_size
from shared.lifecycle import budget, progress
from shared.lifecycle.schemas import Progress
from tests.datasets import write_dataset
from tests.e2e.deployment import Deployment

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def no_budget_left_behind(deployment: Deployment) -> Iterator[None]:
    """The store-wide budget lives in the deployment's Redis, which later tests share: a test that stops half-way
    must not leave them a budget that refuses their jobs."""
    yield
    budget.set_store_budget(deployment.redis, None)


def wait_paused(deployment: Deployment, job_ids: list[str], timeout_s: float = 120) -> Progress:
    """The first of the jobs the API reports paused, as the API reported it. A job is paused until its next shard
    commits, and a shard that was already past the budget check may still commit: the state can go back to running
    between two reads, so what is checked is one read of the API's."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for job_id in job_ids:
            p = Progress.model_validate(deployment.api.get(f"/v1/jobs/{job_id}/progress").json())
            if p.state == "paused":
                return p
        deployment.stack.check_alive()
        time.sleep(0.3)
    raise TimeoutError(f"none of {job_ids} paused")


def committed_once(deployment: Deployment, job_id: str, samples_total: int) -> None:
    counts = Counter(s.sample_index for m in deployment.manifests(job_id) for s in m.samples)
    assert sorted(counts) == list(range(samples_total)) and set(counts.values()) == {1}  # none lost, none twice


def test_a_job_over_the_budget_pauses_and_goes_on_after_a_delete_or_a_raised_budget(
    deployment: Deployment, tmp_path: Path
) -> None:
    api, client = deployment.api, deployment.redis
    dataset, _ = write_dataset(tmp_path / "data.jsonl", with_bad_lines=False, repeat=2)
    spec = {"max_length": 256, "shard_token_budget": 150}

    # What one job of this dataset projects, from a job deleted at once.
    probe = deployment.submit(dataset, job_id="probe", **spec)
    assert api.delete("/v1/jobs/probe", params={"cancel": "true"}).status_code == 200
    projected = probe["projected_bytes"]
    limit = round(1.5 * projected)
    assert api.put("/v1/budget", json={"storage_budget_bytes": limit}).status_code == 200

    # Two jobs that each fit at submit, but not together.
    first = deployment.submit(dataset, job_id="first", **spec)
    second = deployment.submit(dataset, job_id="second", **spec)
    paused = wait_paused(deployment, ["first", "second"])
    assert paused.paused_reason is not None
    assert paused.paused_reason.startswith(f"over the storage budget: job {paused.job_id} shard ")
    assert "over the storage budget (EAGLE3_STORAGE_BUDGET_BYTES) of " in paused.paused_reason
    assert budget.stored_bytes(client) <= limit  # held while both ran

    # Room made: the other job is deleted (cancelled first), and the paused one goes on by itself.
    other = "second" if paused.job_id == "first" else "first"
    deleted = api.delete(f"/v1/jobs/{other}", params={"cancel": "true"})
    assert deleted.status_code == 200, deleted.text
    p = deployment.wait(paused.job_id, timeout_s=180)
    assert p.state == "completed" and p.bytes_stored <= limit
    committed_once(deployment, paused.job_id, first["samples_total"])
    assert deployment.storage.list(f"{other}/") == []

    # A job's own budget, raised while it is paused.
    budget.set_store_budget(client, None)
    third = deployment.submit(dataset, job_id="third", **spec)
    own = api.put("/v1/budget", json={"job_id": "third", "storage_budget_bytes": projected // 3})
    assert own.status_code == 200, own.text
    paused = wait_paused(deployment, ["third"])
    assert "over the job budget of " in (paused.paused_reason or "")
    assert api.put("/v1/budget", json={"job_id": "third", "storage_budget_bytes": None}).status_code == 200
    p = deployment.wait("third", timeout_s=180)
    assert p.state == "completed" and p.paused_reason is None
    committed_once(deployment, "third", third["samples_total"])
    assert second["samples_total"] == third["samples_total"]


def test_the_cli_shows_stored_bytes_and_deletes_jobs(deployment: Deployment, tmp_path: Path) -> None:
    dataset, _ = write_dataset(tmp_path / "data.jsonl", with_bad_lines=False)
    for job_id in ("cli-a", "cli-b"):
        deployment.submit(dataset, job_id=job_id, max_length=256, shard_token_budget=150)
        assert deployment.wait(job_id).state == "completed"
    env = {**os.environ, **deployment.stack.env, "EAGLE3_HOME": str(tmp_path / "cli-home"), "COLUMNS": "250"}

    def eagle3(*argv: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "eagle3", *argv]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)

    listed = eagle3("jobs")
    stored = progress.job_progress(deployment.redis, "cli-a").bytes_stored
    assert listed.returncode == 0 and "cli-a" in listed.stdout and human_size(stored) in listed.stdout
    one = eagle3("delete", "cli-a")
    assert one.returncode == 0, one.stderr[-2000:]
    assert "deleted cli-a: " in one.stdout and deployment.storage.list("cli-a/") == []
    old = eagle3("jobs", "--older-than", "0s")
    assert "cli-b" in old.stdout and "cli-a" not in old.stdout
    every = eagle3("delete", "--older-than", "0s", "--yes")
    assert every.returncode == 0 and "deleted cli-b: " in every.stdout, every.stderr[-2000:]
    assert deployment.storage.list("cli-b/") == [] and "cli-b" not in progress.list_jobs(deployment.redis)
    missing = eagle3("delete", "cli-b")
    assert missing.returncode != 0 and "error 404: job 'cli-b' not found" in missing.stderr
