"""docker-compose.yml on a real Docker engine, as a user runs it: build the image, `--profile cpu up --wait`, jobs
through the published API with a bearer token, the stored tensors against the model, `--scale worker=3`, a
worker killed while it holds a shard, Redis restarted mid-job, the trainer and monitoring profiles, and
`down -v` leaving nothing behind.

The project is copied to a temporary folder (its own `.env`, free host ports, compose project name and image
tag), so a developer's `.env`, stack and images are untouched. The tests run in order on one stack.
"""

import hashlib
import io
import json
import math
import os
import re
import secrets
import shutil
import subprocess
import tarfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from shared.data.datasets import Conversation, read_dataset
from shared.data.demo_data import write_demo_dataset
from shared.data.tokenization import ChatTokenizer
from shared.errors import InvalidSample
from shared.lifecycle.jobs import load_job
from shared.lifecycle.schemas import JobRecord, Manifest
from shared.storage import layout
from shared.storage.objects import Storage, open_storage
from shared.storage.sample_format import decode_sample
from tests.compose.conftest import TIMINGS_S
from tests.fixtures.processes import free_port
from tests.reference_checks import HFReference, assert_matches_layers

# Each step waits on the real engine with bounded waits of its own; on a loaded 2-core machine one step took over
# the suite's 600 s default (the three-worker job: scale-up, 439 s of extraction, the reference check).
pytestmark = [pytest.mark.compose, pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
# What a checkout needs for `docker compose build` and `up` (the build context is narrowed by .dockerignore).
CPU_DRAFT_VOCAB_SIZE = 2048  # the demo's: a drafter that trains at CPU speed
PROJECT_FILES = ("docker-compose.yml", ".env.example", ".dockerignore", "pyproject.toml", "README.md")
PROJECT_DIRS = ("docker", "shared", "services", "eagle3")
FINISHED = {"completed", "completed_with_errors", "cancelled", "failed"}
# Jobs one test leaves for a later one (the tests run in file order on one stack).
JOBS: dict[str, str] = {}

# Each job's tensors are read out of the stack's S3 by the producer's own storage code and streamed back as tar.
EXPORT_JOB = """
import io, sys, tarfile
from shared.settings import get_settings
from shared.storage.objects import open_storage
settings = get_settings()
storage = open_storage(settings.storage_url, settings)
with tarfile.open(fileobj=sys.stdout.buffer, mode="w|") as tar:
    for key in storage.list(sys.argv[1] + "/"):
        data = storage.get(key)
        info = tarfile.TarInfo(key)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
"""


class Stack:
    """One compose project in a copy of the checkout, driven through the `docker compose` CLI."""

    def __init__(self, directory: Path, name: str, api_port: int, prometheus_port: int, token: str) -> None:
        self.directory, self.name, self.token = directory, name, token
        # Anonymous volumes carry no project label: compare the engine's volumes before and after instead.
        self.volumes_before = docker_volumes()
        self.server_errors: list[str] = []  # 5xx answers of the API while waiting for a job
        self.prometheus_url = f"http://127.0.0.1:{prometheus_port}"
        self.api = httpx.Client(
            base_url=f"http://127.0.0.1:{api_port}", timeout=60, headers={"Authorization": f"Bearer {token}"}
        )

    def compose(
        self, *args: str, profiles: tuple[str, ...] = (), env: dict[str, str] | None = None, timeout_s: float = 600
    ) -> subprocess.CompletedProcess[str]:
        command = ["docker", "compose", "--project-name", self.name]
        for profile in profiles:
            command += ["--profile", profile]
        result = subprocess.run(
            [*command, *args],
            cwd=self.directory,
            env={**os.environ, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        assert result.returncode == 0, f"docker compose {' '.join(args)}: {result.stderr[-4000:]}"
        return result

    def timed(self, step: str, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        started = time.monotonic()
        result = self.compose(*args, **kwargs)
        TIMINGS_S[step] = time.monotonic() - started
        return result

    def containers(self, service: str, *, all_states: bool = False) -> list[str]:
        args = ["ps", "--format", "{{.Name}}", *(["--all"] if all_states else []), service]
        return sorted(line for line in self.compose(*args).stdout.split() if line)

    def submit(self, dataset: Path, **spec: object) -> dict[str, Any]:
        with dataset.open("rb") as f:
            response = self.api.post(
                "/v1/jobs/upload", files={"dataset": (dataset.name, f)}, data={"spec": json.dumps(spec)}
            )
        assert response.status_code == 201, response.text
        return response.json()["job"]

    def progress(self, job_id: str) -> dict[str, Any]:
        response = self.api.get(f"/v1/jobs/{job_id}")
        assert response.status_code == 200, response.text
        return response.json()["progress"]

    def wait_finished(self, job_id: str, timeout_s: float, why: str = "") -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                response = self.api.get(f"/v1/jobs/{job_id}")
            except httpx.TransportError:  # the producer busy or restarting
                time.sleep(1)
                continue
            if response.status_code >= 500:  # Redis restarting or loading its AOF: counted, then asked again
                self.server_errors.append(f"{response.status_code} {response.text[:200]}")
                time.sleep(1)
                continue
            assert response.status_code == 200, response.text
            progress = response.json()["progress"]
            if progress["state"] in FINISHED:
                return progress
            time.sleep(1)
        pytest.fail(f"job {job_id} not finished after {timeout_s:.0f}s{why}: {self.progress(job_id)}")

    def export(self, job_id: str, into: Path) -> Storage:
        """The job's objects, copied out of the stack's S3 into a file:// storage with the same keys."""
        result = subprocess.run(
            ["docker", "compose", "--project-name", self.name, "exec", "-T", "producer", "python", "-", job_id],
            cwd=self.directory,
            input=EXPORT_JOB.encode(),
            capture_output=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr.decode()[-3000:]
        with tarfile.open(fileobj=io.BytesIO(result.stdout), mode="r:") as tar:
            tar.extractall(into, filter="data")
        return open_storage(into.as_uri())

    def worker_logs(self) -> str:
        return self.compose("logs", "--no-color", "worker").stdout


def docker_volumes() -> set[str]:
    listing = subprocess.run(["docker", "volume", "ls", "--quiet"], capture_output=True, text=True, timeout=60)
    assert listing.returncode == 0, listing.stderr
    return set(listing.stdout.split())


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str, interval_s: float = 1.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval_s)
    pytest.fail(f"{what}: not seen within {timeout_s:.0f}s")


def copy_project(into: Path) -> None:
    for name in PROJECT_FILES:
        shutil.copy2(REPO / name, into / name)
    for name in PROJECT_DIRS:
        shutil.copytree(REPO / name, into / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.whl"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    directory = tmp_path_factory.mktemp("compose-project")
    copy_project(directory)
    api_port, flower_port, prometheus_port = free_port(), free_port(), free_port()
    token = secrets.token_urlsafe(24)
    env_text = (directory / ".env.example").read_text()
    env_text += (
        "\n# tests/compose\n"
        f"IMAGE_TAG=compose-test\nEAGLE3_API_PORT={api_port}\nFLOWER_PORT={flower_port}\n"
        f"PROMETHEUS_PORT={prometheus_port}\nGRAFANA_PORT={free_port()}\nEAGLE3_API_TOKEN={token}\nSHM_SIZE=1g\n"
    )
    (directory / ".env").write_text(env_text)
    stack = Stack(directory, f"eagle3-test-{uuid.uuid4().hex[:6]}", api_port, prometheus_port, token)
    try:
        stack.timed("build (docker compose build)", "build", timeout_s=1800)
        stack.timed("up, every health check green (up -d --wait)", "up", "-d", "--wait", "--wait-timeout", "900")
        yield stack
    finally:
        stack.api.close()
        # Every container's log, kept with pytest's temporary folders for a post-mortem.
        with (directory / "compose.log").open("wb") as log:
            subprocess.run(
                ["docker", "compose", "--project-name", stack.name, "--profile", "*", "logs", "--no-color", "-t"],
                cwd=directory,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=300,
            )
        # Whatever a failed test left, every profile included (the same command docs/deployment.md gives).
        subprocess.run(
            ["docker", "compose", "--project-name", stack.name, "--profile", "*", "down", "-v", "--timeout", "10"],
            cwd=directory,
            capture_output=True,
            timeout=300,
        )


@pytest.fixture(scope="module")
def reference(smollm2_dir: Path) -> HFReference:
    return HFReference(smollm2_dir)


def manifests_of(storage: Storage, job_id: str) -> list[Manifest]:
    return [Manifest.model_validate_json(storage.get(k)) for k in storage.list(layout.manifests_prefix(job_id))]


def check_job(
    storage: Storage, job_id: str, dataset: Path, model_dir: Path, reference: HFReference
) -> tuple[JobRecord, list[Manifest]]:
    """Every sample committed exactly once, its bytes as the manifest says, its tokens as the tokenizer makes
    them, and its hidden states equal to the model's own layers (the check of tests/e2e/test_pipeline.py)."""
    record = load_job(storage, job_id)
    manifests = manifests_of(storage, job_id)
    assert len(manifests) == record.shards_total
    samples = [s for m in manifests for s in m.samples]
    assert sorted(s.sample_index for s in samples) == list(range(record.samples_total)), "a sample lost or doubled"

    tokenizer = ChatTokenizer.from_pretrained(model_dir)
    expected = {}
    for item in read_dataset(dataset.read_text().splitlines()):
        if isinstance(item, Conversation):
            try:
                expected[item.sample_id] = tokenizer.tokenize(
                    item, max_length=record.spec.max_length, length_policy=record.spec.length_policy
                )
            except InvalidSample:
                continue
    for s in samples:
        data = storage.get(s.key)
        assert len(data) == s.bytes and hashlib.sha256(data).hexdigest() == s.sha256, s.key
        stored = decode_sample(data)
        assert stored["input_ids"].tolist() == expected[s.sample_id].input_ids
        assert stored["loss_mask"].tolist() == expected[s.sample_id].loss_mask
        assert_matches_layers(stored, reference, record.aux_layer_ids)
    return record, manifests


def test_api_refuses_a_job_without_the_token(stack: Stack, tmp_path: Path) -> None:
    dataset = write_demo_dataset(tmp_path / "demo.jsonl", num_conversations=2)
    with dataset.open("rb") as f:
        response = httpx.post(
            f"{stack.api.base_url}/v1/jobs/upload", files={"dataset": f}, data={"spec": "{}"}, timeout=30
        )
    assert response.status_code in (401, 403), response.text


def test_demo_job_through_the_published_api_matches_the_model(
    stack: Stack, tmp_path: Path, smollm2_dir: Path, reference: HFReference
) -> None:
    dataset = write_demo_dataset(tmp_path / "demo.jsonl", num_conversations=16)
    started = time.monotonic()
    job = stack.submit(dataset)
    progress = stack.wait_finished(job["job_id"], timeout_s=600)
    TIMINGS_S["job 1: 16 demo conversations, 1 worker"] = time.monotonic() - started
    assert progress["state"] == "completed", progress

    storage = stack.export(job["job_id"], tmp_path / "storage")
    record, manifests = check_job(storage, job["job_id"], dataset, smollm2_dir, reference)
    assert progress["samples_done"] == record.samples_total == 16
    assert progress["tokens_done"] == record.tokens_total == sum(m.num_tokens for m in manifests)


def test_three_workers_share_a_job(stack: Stack, tmp_path: Path, smollm2_dir: Path, reference: HFReference) -> None:
    stack.timed("scale to 3 workers (up -d --wait --scale worker=3)", "up", "-d", "--wait", "--scale", "worker=3")
    assert len(stack.containers("worker")) == 3

    dataset = write_demo_dataset(tmp_path / "demo.jsonl", num_conversations=24, seed=1)
    started = time.monotonic()
    # The trainer below trains on this job: a draft vocabulary sized for a CPU, as `make demo` uses (the default
    # 32,000 trains at about 80 tokens/s on 2 cores, SmolLM2's step being mostly the draft vocabulary's logits).
    job = stack.submit(dataset, shard_token_budget=256, draft_vocab_size=CPU_DRAFT_VOCAB_SIZE)
    progress = stack.wait_finished(job["job_id"], timeout_s=600)
    TIMINGS_S[f"job 2: 24 conversations, {job['shards_total']} shards, 3 workers"] = time.monotonic() - started
    assert progress["state"] == "completed", progress

    storage = stack.export(job["job_id"], tmp_path / "storage")
    _, manifests = check_job(storage, job["job_id"], dataset, smollm2_dir, reference)
    by_worker: dict[str, int] = {}
    for m in manifests:
        by_worker[m.worker] = by_worker.get(m.worker, 0) + 1
    assert len(by_worker) == 3, f"shards per worker: {by_worker}"
    JOBS["three workers"] = job["job_id"]  # the trainer's job, below


def held_shard_container(logs: str, job_id: str) -> str | None:
    """A worker container that has received one of the job's shards and not yet finished it (Celery's INFO lines;
    a shard's task id is `<job id>:shard:<index>`)."""
    received: dict[str, str] = {}
    for line in logs.splitlines():
        container, _, message = line.partition("|")
        if match := re.search(rf"Task [\w.]+\[({re.escape(job_id)}:[^\]]+)\] received", message):
            received[match.group(1)] = container.strip()
        elif match := re.search(r"Task [\w.]+\[([^\]]+)\] (succeeded|retry|raised)", message):
            received.pop(match.group(1), None)
    return next(iter(received.values()), None)


def test_killed_worker_shard_is_recovered_and_committed_once(stack: Stack, tmp_path: Path) -> None:
    try:
        import shared.lifecycle.leases  # noqa: F401
    except ImportError:
        pytest.skip(
            "shard leases (shared/lifecycle/leases.py) are not in this checkout: without them a killed worker's shard "
            "waits out the 4-hour visibility timeout"
        )
    dataset = write_demo_dataset(tmp_path / "demo.jsonl", num_conversations=24, seed=2)
    job = stack.submit(dataset, shard_token_budget=256)
    victim: list[str] = []

    def a_worker_holds_a_shard() -> bool:
        container = held_shard_container(stack.worker_logs(), job["job_id"])
        if container:
            victim.append(container)
        return bool(container)

    wait_for(a_worker_holds_a_shard, timeout_s=120, what="a worker holding a shard")
    # `compose logs` prefixes lines with the service and index (worker-2), the container is <project>-worker-2.
    (container,) = [c for c in stack.containers("worker") if c.endswith(f"-{victim[-1]}")]
    killed_at = time.monotonic()
    subprocess.run(["docker", "kill", container], check=True, capture_output=True, timeout=60)
    progress = stack.wait_finished(
        job["job_id"],
        timeout_s=420,
        why=f" after docker kill {container}: its shard should have been re-queued when its lease ran out",
    )
    TIMINGS_S["job 3: completed after a worker was killed mid-shard"] = time.monotonic() - killed_at
    assert progress["state"] == "completed", progress
    storage = stack.export(job["job_id"], tmp_path / "storage")
    record = load_job(storage, job["job_id"])
    indices = sorted(s.sample_index for m in manifests_of(storage, job["job_id"]) for s in m.samples)
    assert indices == list(range(record.samples_total)), "a sample lost or committed twice"
    stack.compose("up", "-d", "--wait", "--scale", "worker=3")  # back to three for what follows


def test_redis_restart_mid_job_loses_nothing(stack: Stack, tmp_path: Path) -> None:
    dataset = write_demo_dataset(tmp_path / "demo.jsonl", num_conversations=32, seed=3)
    job = stack.submit(dataset, shard_token_budget=256)
    job_id = job["job_id"]
    wait_for(
        lambda: 0 < stack.progress(job_id)["shards_committed"] < job["shards_total"] - 3,
        timeout_s=300,
        what="the job part-way done",
        interval_s=0.5,
    )
    before = stack.progress(job_id)
    stack.timed("redis container restart (AOF reload)", "restart", "redis")
    errors_before = len(stack.server_errors)
    progress = stack.wait_finished(job_id, timeout_s=600, why=" after the Redis restart")
    TIMINGS_S["API 5xx answers while Redis restarted (count, not seconds)"] = len(stack.server_errors) - errors_before
    assert progress["state"] == "completed", progress
    assert progress["shards_committed"] >= before["shards_committed"]

    storage = stack.export(job_id, tmp_path / "storage")
    record = load_job(storage, job_id)
    manifests = manifests_of(storage, job_id)
    assert len(manifests) == record.shards_total
    indices = sorted(s.sample_index for m in manifests for s in m.samples)
    assert indices == list(range(record.samples_total)), "a sample lost or committed twice"
    # The counters kept in Redis survived too: they agree with what storage holds.
    assert progress["samples_done"] == record.samples_total
    assert progress["tokens_done"] == record.tokens_total == sum(m.num_tokens for m in manifests)
    assert progress["shards_committed"] == record.shards_total


def test_trainer_profile_trains_on_a_job(stack: Stack) -> None:
    job_id = JOBS.get("three workers")
    if job_id is None:
        pytest.fail("no finished job from test_three_workers_share_a_job to train on")
    started = time.monotonic()
    stack.compose("up", "-d", "trainer", profiles=("cpu", "train"), env={"TRAIN_JOB": job_id})
    containers = stack.containers("trainer", all_states=True)
    assert len(containers) == 1, f"trainer containers: {containers}"
    trainer = containers[0]

    def exited() -> bool:
        state = subprocess.run(
            ["docker", "inspect", "--format", "{{.State.Status}}", trainer],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.split()
        return state[:1] == ["exited"]

    wait_for(exited, timeout_s=900, what="the trainer finishing its job", interval_s=2)
    TIMINGS_S["trainer on job 2 (profile train)"] = time.monotonic() - started
    inspect = subprocess.run(
        ["docker", "inspect", "--format", "{{.State.ExitCode}}", trainer], capture_output=True, text=True, timeout=30
    )
    logs = subprocess.run(["docker", "logs", trainer], capture_output=True, text=True, timeout=60)
    assert inspect.stdout.strip() == "0", logs.stdout[-3000:] + logs.stderr[-3000:]
    # The summary is the last JSON object on stdout (logs go to stderr); it may be all there is.
    stdout = "\n" + logs.stdout
    summary = json.loads(stdout[stdout.rindex("\n{") :])
    assert summary["job_id"] == job_id
    assert summary["steps"] > 0 and summary["train_tokens"] > 0, summary
    assert summary["final_loss"] is not None and math.isfinite(summary["final_loss"]), summary


def test_monitoring_profile_scrapes_the_producer(stack: Stack) -> None:
    # Flower and Prometheus by name: Grafana's image is not among those a registry-less engine has.
    stack.timed(
        "monitoring profile up (Flower, Prometheus)",
        "up", "-d", "--wait", "flower", "prometheus",
        profiles=("cpu", "monitoring"),
    )  # fmt: skip

    def producer_scraped() -> bool:
        try:
            targets = httpx.get(f"{stack.prometheus_url}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        return any(t["labels"]["job"] == "producer" and t["health"] == "up" for t in targets)

    wait_for(producer_scraped, timeout_s=120, what="Prometheus scraping the producer")


def test_down_removes_every_profile_and_volume(stack: Stack) -> None:
    stack.timed("down -v, every profile (--profile '*' down -v)", "down", "-v", profiles=("*",))
    label = f"label=com.docker.compose.project={stack.name}"
    for what in (["ps", "--all"], ["volume", "ls"], ["network", "ls"]):
        listing = subprocess.run(
            ["docker", *what, "--quiet", "--filter", label], capture_output=True, text=True, timeout=60, check=True
        )
        assert listing.stdout.strip() == "", f"docker {' '.join(what)} after down -v: {listing.stdout}"
    assert docker_volumes() <= stack.volumes_before, "down -v left anonymous volumes"
