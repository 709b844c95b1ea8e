"""Deleting jobs, retention, trimming and storage budgets, against a real Redis, a real SeaweedFS S3 (through the
fault proxy where storage must fail part way), real file storage, and the reference server for real shards."""

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import redis

from services.producer.deps import get_storage
from services.trainer.data import ShardFollower, TargetSignature
from shared.errors import JobDeleting, JobNotFound, OverBudget, OverStorageBudget, StorageUnavailable, SubmitError
from shared.lifecycle import budget, deletion, followers, jobs, progress, recovery
from shared.lifecycle.kind import read_shard_input
from shared.lifecycle.kinds import EXTRACT
from shared.lifecycle.schemas import Manifest
from shared.redis_replies import stream_entries
from shared.settings import Settings
from shared.storage import layout
from shared.storage.objects import Storage, open_storage
from tests.datasets import write_dataset
from tests.faults.fault_proxy import fault_proxy
from tests.fixtures.processes import free_port, kill_if_running, wait_until
from tests.integration.test_extraction import extract, plan
from tests.integration.test_producer_api import Api, api_settings, make_api
from tests.integration.test_progress import make_job, make_manifest

DAY_S = 86400.0


def job_redis_keys(client: redis.Redis, job_id: str) -> set[bytes]:
    """Every Redis key that names the job, and every shared structure that holds it."""
    keys = {key for pattern in ("*:{}", "*:{}:*", "*|{}|*") for key in client.scan_iter(match=pattern.format(job_id))}
    if client.zscore(progress.JOBS_INDEX, job_id) is not None:
        keys.add(b"member of " + progress.JOBS_INDEX.encode())
    if any(m.startswith(f"{job_id}|".encode()) for m in client.hkeys(budget.RESERVED)):
        keys.add(b"reservation")
    return keys


def run_all(job: jobs.JobRecord, storage: Storage, redis_url: str, server: str) -> None:
    for shard in range(job.shards_total):
        assert extract(job.job_id, shard, storage, redis_url, server).status == "committed"


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


# ---------------------------------------------------------------------------------------------------------------------
# Delete


def test_delete_of_a_completed_job_removes_every_object_key_and_index_entry_and_nothing_of_another(
    tmp_path: Path,
    tiny_model_dir: Path,
    redis_url: str,
    client: redis.Redis,
    s3_storage_url: str,
    reference_server_url: str,
) -> None:
    storage = open_storage(s3_storage_url, Settings())  # Settings() reads the server the fixture set
    doomed = plan(tmp_path, tiny_model_dir, redis_url, storage, shard_token_budget=100, job_id="doomed")
    other = plan(tmp_path, tiny_model_dir, redis_url, storage, shard_token_budget=100, job_id="doomed-not")
    run_all(doomed, storage, redis_url, reference_server_url)
    run_all(other, storage, redis_url, reference_server_url)
    checkpoint = layout.trainer_checkpoint("doomed", "run-1", 10)
    storage.put(checkpoint, b"weights")
    other_objects = storage.list("doomed-not/")
    other_keys = job_redis_keys(client, "doomed-not")
    assert progress.job_progress(client, "doomed").state == "completed"
    assert len(storage.list("doomed/")) > 2 * doomed.shards_total and job_redis_keys(client, "doomed")

    report = deletion.delete_job("doomed", storage=storage, client=client)

    assert storage.list("doomed/") == [checkpoint]  # checkpoints stay unless asked
    assert report.objects_kept == 1 and report.objects_deleted > 2 * doomed.shards_total
    assert not storage.exists(layout.job_index_entry("doomed"))
    assert job_redis_keys(client, "doomed") == set()
    assert "doomed" not in progress.list_jobs(client)
    with pytest.raises(JobNotFound):
        progress.job_progress(client, "doomed")
    # Nothing of the other job (whose id starts with the deleted one's) went.
    assert storage.list("doomed-not/") == other_objects and storage.exists(layout.job_index_entry("doomed-not"))
    assert job_redis_keys(client, "doomed-not") == other_keys
    assert progress.job_progress(client, "doomed-not").state == "completed"

    deletion.delete_job("doomed", storage=storage, client=client, with_checkpoints=True)
    assert storage.list("doomed/") == []
    with pytest.raises(JobNotFound):
        deletion.delete_job("doomed", storage=storage, client=client)


def test_a_local_folder_delete_removes_the_files_and_their_folders(
    tmp_path: Path, tiny_model_dir: Path, redis_url: str, client: redis.Redis, reference_server_url: str
) -> None:
    storage = open_storage((tmp_path / "store").as_uri())
    job = plan(tmp_path, tiny_model_dir, redis_url, storage, shard_token_budget=100, job_id="local")
    run_all(job, storage, redis_url, reference_server_url)
    deletion.delete_job("local", storage=storage, client=client, with_checkpoints=True)
    assert not (tmp_path / "store" / "local").exists()
    assert not (tmp_path / "store" / layout.job_index_entry("local")).exists()
    assert (tmp_path / "store" / "_jobs").is_dir()  # the index's folder itself stays


@pytest.fixture
def api(redis_url: str, tmp_path: Path, tiny_model_dir: Path) -> Iterator[Api]:
    yield from make_api(api_settings(tmp_path, tiny_model_dir, redis_url=redis_url))


def submit(api: Api, tmp_path: Path, model: Path, job_id: str) -> dict:
    dataset, _ = write_dataset(tmp_path / "data.jsonl", with_bad_lines=False)
    response = api.client.post(
        "/v1/jobs", json={"dataset_url": str(dataset), "model_path": str(model), "job_id": job_id}
    )
    assert response.status_code == 201, response.text
    return response.json()["job"]


def test_delete_is_refused_for_a_running_job_and_a_followed_one_and_needs_the_token(
    api: Api, tmp_path: Path, tiny_model_dir: Path, client: redis.Redis
) -> None:
    submit(api, tmp_path, tiny_model_dir, "busy")
    assert api.client.delete("/v1/jobs/busy", headers={"Authorization": ""}).status_code == 401
    refused = api.client.delete("/v1/jobs/busy")
    assert refused.status_code == 409
    assert (
        refused.json()["detail"]
        == "job busy is queued: cancel it first (`eagle3 cancel busy`), or delete with --cancel"
    )
    assert api.client.get("/v1/jobs/busy/progress").json()["state"] == "queued"  # untouched

    api.client.post("/v1/jobs/busy/cancel")
    mark = followers.FollowerMark(client, "busy")
    try:
        refused = api.client.delete("/v1/jobs/busy")
        assert refused.status_code == 409
        assert refused.json()["detail"].startswith(f"job busy is followed by a running trainer ({mark.name})")
        assert api.client.get("/v1/jobs/busy/progress").json()["state"] == "cancelled"
        forced = api.client.delete("/v1/jobs/busy", params={"force": "true"})
        assert forced.status_code == 200, forced.text
    finally:
        mark.stop()
    assert api.client.get("/v1/jobs/busy/progress").status_code == 404

    submit(api, tmp_path, tiny_model_dir, "busy-2")
    report = api.client.delete("/v1/jobs/busy-2", params={"cancel": "true"}).json()
    assert report["cancelled"] and report["objects_deleted"] > 0
    assert api.client.get("/v1/jobs").json() == []


def test_a_delete_interrupted_by_s3_shows_deleting_and_finishes_when_run_again(
    tmp_path: Path,
    tiny_model_dir: Path,
    redis_url: str,
    client: redis.Redis,
    s3_server,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    direct = open_storage(s3_server.storage_url("interrupted"), Settings(s3_endpoint_url=s3_server.endpoint_url))
    plan(tmp_path, tiny_model_dir, redis_url, direct, job_id="big")
    jobs.cancel("big", storage=direct, client=client)
    with ThreadPoolExecutor(16) as pool:  # more than one DeleteObjects request's worth
        list(pool.map(lambda i: direct.put(layout.sample("big", i), b"x" * 64), range(1500)))
    before = len(direct.list("big/"))

    with fault_proxy(s3_server.endpoint_url) as proxy:
        through = open_storage(s3_server.storage_url("interrupted"), Settings(s3_endpoint_url=proxy.endpoint_url))
        deletes = []

        def fail_after_the_first_batch(head: bytes) -> None:
            if head.startswith(b"POST") and b"?delete" in head.split(b"\r\n", 1)[0]:
                deletes.append(head)
                if len(deletes) > 1:
                    proxy.fault = "slowdown"  # S3 answers 503 from here on

        proxy.on_request = fail_after_the_first_batch
        with pytest.raises(StorageUnavailable):
            deletion.delete_job("big", storage=through, client=client)

    # Half deleted, and visibly so: deleting in Redis (status, jobs, API) and in storage's index.
    left = direct.list("big/")
    assert before - len(left) == deletion.DELETE_BATCH and layout.job_json("big") in left
    assert progress.job_progress(client, "big").state == "deleting"
    assert recovery.deleting_detail(direct, "big") is not None
    with pytest.raises(JobDeleting):
        jobs.resume("big", storage=direct, client=client, enqueue=lambda *a: None)
    with pytest.raises(SubmitError, match="already exists"):  # nor may a submit of the same id plan over it
        plan(tmp_path, tiny_model_dir, redis_url, direct, job_id="big")

    # Redis lost meanwhile: recovery brings the job back as deleting, and enqueues nothing.
    client.flushdb()
    enqueued: list[int] = []
    recovery.recover_jobs(direct, client, enqueue=lambda kind, job_id, shard: enqueued.append(shard))
    assert enqueued == [] and progress.job_progress(client, "big").state == "deleting"

    report = deletion.delete_job("big", storage=direct, client=client)
    assert report.finished_earlier_delete and report.objects_deleted == len(left)
    assert direct.list("big/") == [] and not direct.exists(layout.job_index_entry("big"))
    assert job_redis_keys(client, "big") == set()


# ---------------------------------------------------------------------------------------------------------------------
# A delete stopped mid-way: its process killed, Redis refusing connections. A hook on the real storage stops it at a
# precise point; everything else is real (SeaweedFS S3, redis-server, the producer's routes for what follows).

REPO = Path(__file__).resolve().parents[2]


def stored_job(tmp_path: Path, model: Path, redis_url: str, storage: Storage, job_id: str, samples: int) -> None:
    """A cancelled job as a run leaves it: planned (job.json, shard inputs, index entry, progress hash, place in the
    job list), shard 0 committed (its manifest, count, committed set and event), `samples` sample objects and a
    trainer checkpoint."""
    client = redis.Redis.from_url(redis_url)
    plan(tmp_path, model, redis_url, storage, job_id=job_id)
    progress.commit_manifest(storage, client, make_manifest(0).model_copy(update={"job_id": job_id}))
    jobs.cancel(job_id, storage=storage, client=client)
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: storage.put(layout.sample(job_id, i), b"x" * 64), range(samples)))
    storage.put(layout.trainer_checkpoint(job_id, "run-1", 10), b"weights")


def everything_of(storage: Storage, client: redis.Redis, job_id: str) -> tuple[object, ...]:
    """A job's objects with their bytes, its index entry, its Redis keys and its progress hash."""
    objects = {key: storage.get(key) for key in storage.list(f"{job_id}/")}
    index = storage.get(layout.job_index_entry(job_id)) if storage.exists(layout.job_index_entry(job_id)) else None
    return objects, index, job_redis_keys(client, job_id), client.hgetall(progress.job_key(job_id))


class StopsAt:
    """The real storage of a delete, calling `stop` once the delete of `job_id` reaches `point`: "marked" (its index
    entry says deleting), "first batch" (one DeleteObjects of its objects done), "objects" (job.json, its last object,
    gone), "index entry" (about to remove its index entry)."""

    def __init__(self, storage: Storage, job_id: str, point: str, stop: Callable[[], None]) -> None:
        self.storage, self.job_id, self.point, self.stop = storage, job_id, point, stop
        self.batches = 0

    def __getattr__(self, name: str) -> Any:  # every other call: the real storage's
        return getattr(self.storage, name)

    def _reached(self, point: str) -> None:
        if point == self.point:
            self.stop()

    def put(self, key: str, data: bytes) -> None:
        self.storage.put(key, data)
        if key == layout.job_index_entry(self.job_id):
            self._reached("marked")

    def delete_many(self, keys: Sequence[str]) -> None:
        self.storage.delete_many(keys)
        self.batches += 1
        if self.batches == 1:
            self._reached("first batch")
        if layout.job_json(self.job_id) in keys:
            self._reached("objects")

    def delete(self, key: str) -> None:
        if key == layout.job_index_entry(self.job_id):
            self._reached("index entry")
        self.storage.delete(key)


def delete_until_killed(job_id: str, redis_url: str, point: str, stopped: str) -> None:
    """The process the kill test runs (`python -c`): a delete with --with-checkpoints over the real S3 storage (from
    EAGLE3_*) and Redis, which writes `stopped` once it reaches `point` and waits there to be killed."""

    def wait_for_the_kill() -> None:
        Path(stopped).write_text(point)
        time.sleep(600)

    settings = Settings()
    storage = StopsAt(open_storage(settings.storage_url, settings), job_id, point, wait_for_the_kill)
    deletion.delete_job(job_id, storage=storage, client=redis.Redis.from_url(redis_url), with_checkpoints=True)
    raise SystemExit(f"the delete of {job_id} ended without reaching {point!r}")


def check_nothing_looks_whole(api: Api, storage: Storage, tmp_path: Path, model: Path, job_id: str) -> str | None:
    """What a stopped delete leaves, seen through the producer's routes (what `eagle3 status`, `eagle3 jobs` and the
    dashboard read): the job shows the same state in its progress and in the job list, or nowhere, in which case its
    index entry still says deleting; a resume enqueues nothing and a submit of its id is refused. Returns the state
    shown, or None."""
    shown = api.client.get(f"/v1/jobs/{job_id}/progress")
    listed = {p["job_id"]: p["state"] for p in api.client.get("/v1/jobs").json()}
    state = None
    if shown.status_code == 200:
        state = shown.json()["state"]
        assert listed[job_id] == state
    else:
        assert shown.status_code == 404 and job_id not in listed, shown.text
        assert recovery.deleting_detail(storage, job_id) is not None  # its index entry: a re-run finishes it
    resumed = api.client.post(f"/v1/jobs/{job_id}/resume")
    assert resumed.status_code == (409 if storage.exists(layout.job_json(job_id)) else 404), resumed.text
    dataset, _ = write_dataset(tmp_path / "data.jsonl", with_bad_lines=False)
    again = api.client.post("/v1/jobs", json={"dataset_url": str(dataset), "model_path": str(model), "job_id": job_id})
    assert again.status_code == 409, again.text  # never planned over what is left of it
    assert api.enqueued == []
    return state


@pytest.mark.parametrize("point", ["marked", "first batch", "objects", "index entry"])
def test_a_delete_killed_mid_way_leaves_nothing_that_looks_whole_and_finishes_when_run_again(
    point: str,
    tmp_path: Path,
    tiny_model_dir: Path,
    redis_url: str,
    client: redis.Redis,
    s3_storage_url: str,
) -> None:
    storage = open_storage(s3_storage_url, Settings())  # Settings() reads the server the fixture set
    samples = deletion.DELETE_BATCH + 100 if point == "first batch" else 20  # "first batch": one DeleteObjects of two
    stored_job(tmp_path, tiny_model_dir, redis_url, storage, "big", samples)
    stored_job(tmp_path, tiny_model_dir, redis_url, storage, "big-not", 20)
    before = storage.list("big/")
    neighbour = everything_of(storage, client, "big-not")

    stopped, log = tmp_path / "stopped", tmp_path / "deleter.log"
    with log.open("wb") as out:
        deleter = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; from tests.integration.test_deletion import delete_until_killed as d; d(*sys.argv[1:])",
                "big",
                redis_url,
                point,
                str(stopped),
            ],
            env={**os.environ, "PYTHONPATH": str(REPO)},
            cwd=tmp_path,  # away from the checkout's .env: the environment alone configures it
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_until(lambda: stopped.exists() or deleter.poll() is not None, timeout_s=120)
        assert deleter.poll() is None, log.read_text()
        deleter.send_signal(signal.SIGKILL)
        assert deleter.wait(timeout=10) == -signal.SIGKILL
    finally:
        kill_if_running(deleter)

    left = storage.list("big/")
    redis_left = job_redis_keys(client, "big")
    assert recovery.deleting_detail(storage, "big") is not None  # every point: the index entry says deleting
    if point == "marked":  # nothing removed yet: the job is whole, its Redis hash not yet marked
        assert left == before and progress.committed_key("big").encode() in redis_left
    elif point == "first batch":  # 1,000 objects gone, job.json (the last to go) still there
        assert len(before) - len(left) == deletion.DELETE_BATCH and layout.job_json("big") in left
    elif point == "objects":  # every object gone, checkpoints too (asked); the Redis keys not yet
        assert left == [] and progress.committed_key("big").encode() in redis_left
    else:  # "index entry": nothing left but the index entry (the Redis hash went before it)
        assert left == [] and redis_left == set()

    for api in make_api(api_settings(tmp_path, tiny_model_dir, redis_url=redis_url, storage_url=s3_storage_url)):
        state = check_nothing_looks_whole(api, storage, tmp_path, tiny_model_dir, "big")
        # Marked in storage only, nothing removed: its former state. Anything removed: `deleting`, or nowhere once
        # its Redis hash went before its index entry.
        assert state == {"marked": "cancelled", "index entry": None}.get(point, "deleting")

        again = api.client.delete("/v1/jobs/big")  # what `eagle3 delete big` asks
        assert again.status_code == 200, again.text
        report = again.json()
        assert report["finished_earlier_delete"] and report["objects_deleted"] == len(left)
        assert api.client.get("/v1/jobs/big/progress").status_code == 404
        assert "big" not in {p["job_id"] for p in api.client.get("/v1/jobs").json()}
        assert api.client.delete("/v1/jobs/big").status_code == 404  # nothing of it left to delete
        assert api.client.get("/v1/jobs/big-not/progress").json()["state"] == "cancelled"
    assert storage.list("big/") == []  # the checkpoints too, as the killed delete was asked
    assert not storage.exists(layout.job_index_entry("big")) and job_redis_keys(client, "big") == set()
    assert everything_of(storage, client, "big-not") == neighbour


class RestartableRedis:
    """A redis-server of the test's own with an append-only file. `stop()` is a container's stop (SIGTERM: it writes
    the file and exits; connections are refused from then on), `start()` serves the same data on the same port."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir()
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        self.argv += ["--appendonly", "yes", "--dir", str(folder)]
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL)
        wait_until(lambda: redis.Redis(port=self.port).ping(), timeout_s=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RestartableRedis]:
    server = RestartableRedis(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("point", ["marked", "first batch", "objects", "redis keys"])
def test_a_delete_redis_refuses_mid_way_answers_503_and_finishes_when_run_again_once_redis_is_back(
    point: str,
    tmp_path: Path,
    tiny_model_dir: Path,
    own_redis: RestartableRedis,
    s3_storage_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    storage = open_storage(s3_storage_url, Settings())
    client = redis.Redis.from_url(own_redis.url)
    samples = deletion.DELETE_BATCH + 100 if point == "first batch" else 20
    stored_job(tmp_path, tiny_model_dir, own_redis.url, storage, "big", samples)
    stored_job(tmp_path, tiny_model_dir, own_redis.url, storage, "big-not", 20)
    before = storage.list("big/")
    neighbour = everything_of(storage, client, "big-not")
    checkpoint = layout.trainer_checkpoint("big", "run-1", 10)

    # Redis stops when the delete reaches the point: every Redis call of the delete from there on is refused. At
    # "redis keys", once the job's Redis keys but its hash are gone: the delete's last step meets it.
    hooked = StopsAt(storage, "big", point, own_redis.stop)
    remove_keys = deletion._delete_redis_keys

    def then_redis_stops(client: redis.Redis, job_id: str) -> int:
        removed = remove_keys(client, job_id)
        own_redis.stop()
        return removed

    settings = api_settings(tmp_path, tiny_model_dir, redis_url=own_redis.url, storage_url=s3_storage_url)
    for api in make_api(settings):
        app: Any = api.client.app
        app.dependency_overrides[get_storage] = lambda: hooked
        with monkeypatch.context() as patch:
            if point == "redis keys":
                patch.setattr(deletion, "_delete_redis_keys", then_redis_stops)
            refused = api.client.delete("/v1/jobs/big")
        del app.dependency_overrides[get_storage]
        assert refused.status_code == 503 and refused.headers["Retry-After"], refused.text
        assert refused.json()["detail"].startswith("Redis at ")
        assert own_redis.process is not None and own_redis.process.poll() is not None  # it did stop there

        left = storage.list("big/")
        if point == "marked":  # refused at the Redis mark: nothing removed
            assert left == before
        else:  # the objects went on going without Redis (checkpoints kept); its Redis keys could not
            assert left == [checkpoint]
        assert recovery.deleting_detail(storage, "big") is not None  # its index entry: a re-run finishes it

        own_redis.start()  # back, with its data
        state = check_nothing_looks_whole(api, storage, tmp_path, tiny_model_dir, "big")
        assert state == ("cancelled" if point == "marked" else "deleting")

        again = api.client.delete("/v1/jobs/big")
        assert again.status_code == 200, again.text
        report = again.json()
        assert report["finished_earlier_delete"] and report["objects_kept"] == 1
        assert api.client.get("/v1/jobs/big/progress").status_code == 404
        assert api.client.delete("/v1/jobs/big").status_code == 404
    assert storage.list("big/") == [checkpoint]  # kept: neither delete asked for the checkpoints
    assert not storage.exists(layout.job_index_entry("big")) and job_redis_keys(client, "big") == set()
    assert everything_of(storage, client, "big-not") == neighbour


# ---------------------------------------------------------------------------------------------------------------------
# Retention and trimming


def age(client: redis.Redis, job_id: str, days: float) -> None:
    """Move a job's creation (and so its end, for a job that never committed) back by `days`."""
    key = progress.job_key(job_id)
    client.hset(key, "created_ts", float(client.hget(key, "created_ts") or 0) - days * DAY_S)


def test_retention_deletes_only_finished_jobs_past_the_age(
    tmp_path: Path, tiny_model_dir: Path, redis_url: str, client: redis.Redis
) -> None:
    storage = open_storage((tmp_path / "store").as_uri())
    for job_id in ("old-cancelled", "old-running", "new-cancelled", "old-followed"):
        plan(tmp_path, tiny_model_dir, redis_url, storage, job_id=job_id)
    for job_id in ("old-cancelled", "new-cancelled", "old-followed"):
        jobs.cancel(job_id, storage=storage, client=client)
    for job_id in ("old-cancelled", "old-running", "old-followed"):
        age(client, job_id, 8)
    age(client, "new-cancelled", 6)

    expired = deletion.expired_jobs(client, 7 * DAY_S)
    assert sorted(p.job_id for p in expired) == ["old-cancelled", "old-followed"]
    mark = followers.FollowerMark(client, "old-followed")
    try:
        settings = Settings(redis_url=redis_url, storage_url=storage.url, retention_days=7)
        reports = deletion.maintain(storage, client, settings)
    finally:
        mark.stop()
    assert [r.job_id for r in reports] == ["old-cancelled"]
    assert sorted(progress.list_jobs(client)) == ["new-cancelled", "old-followed", "old-running"]
    assert storage.list("old-cancelled/") == [] and storage.exists(layout.job_json("old-running"))
    assert deletion.maintain(storage, client, settings.model_copy(update={"retention_days": None})) == []


def test_the_producer_applies_the_retention_on_its_schedule(
    redis_url: str, tmp_path: Path, tiny_model_dir: Path, client: redis.Redis
) -> None:
    settings = api_settings(tmp_path, tiny_model_dir, redis_url=redis_url)
    storage = open_storage(settings.storage_url)
    plan(tmp_path, tiny_model_dir, redis_url, storage, job_id="expired")
    jobs.cancel("expired", storage=storage, client=client)
    age(client, "expired", 3)
    for api in make_api(settings.model_copy(update={"retention_days": 2.0})):
        wait_until(lambda: not client.exists(progress.job_key("expired")), timeout_s=30)
        assert api.client.get("/v1/jobs").json() == []
    assert storage.list("expired/") == []


def test_finished_jobs_events_are_trimmed_unless_a_trainer_follows(client: redis.Redis) -> None:
    shards = deletion.FINISHED_EVENTS_KEPT + 50
    progress.register_job(client, make_job(shards=shards), "file:///tmp/x", EXTRACT)
    for shard in range(shards - 1):
        progress.record_commit(client, make_manifest(shard))
    assert deletion.trim_finished_events(client) == []  # running
    progress.record_commit(client, make_manifest(shards - 1))
    mark = followers.FollowerMark(client, "job-a")
    assert deletion.trim_finished_events(client) == []  # followed
    mark.stop()
    assert deletion.trim_finished_events(client) == ["job-a"]
    events = stream_entries(client.xrange(progress.events_key("job-a")))
    assert len(events) == deletion.FINISHED_EVENTS_KEPT
    assert int(events[-1][1][b"shard_index"]) == shards - 1  # the newest stay
    p = progress.job_progress(client, "job-a")
    assert p.state == "completed" and p.tokens_done == p.tokens_total


# ---------------------------------------------------------------------------------------------------------------------
# Budgets


def test_a_shard_that_would_cross_a_budget_writes_nothing_and_goes_on_once_it_fits(
    tmp_path: Path, tiny_model_dir: Path, redis_url: str, client: redis.Redis, reference_server_url: str
) -> None:
    storage = open_storage((tmp_path / "store").as_uri())
    job = plan(tmp_path, tiny_model_dir, redis_url, storage, shard_token_budget=100, job_id="budgeted")
    assert job.shards_total >= 4
    first = extract("budgeted", 0, storage, redis_url, reference_server_url)
    budget.set_job_budget(client, "budgeted", first.bytes + 10)  # nothing more fits
    with pytest.raises(OverStorageBudget) as refused:
        extract("budgeted", 1, storage, redis_url, reference_server_url)
    assert str(refused.value).startswith("job budgeted shard 1 needs about ")
    assert "over the job budget of " in str(refused.value)
    assert not storage.exists(layout.manifest("budgeted", 1))
    shard_one = [s.sample_index for s in read_shard_input(EXTRACT, storage, "budgeted", 1).samples]
    assert not any(storage.exists(layout.sample("budgeted", i)) for i in shard_one)
    assert client.hlen(budget.RESERVED) == 0  # a refused shard holds no reservation

    # The store-wide budget counts every job's stored bytes: another job's count fills it.
    budget.set_job_budget(client, "budgeted", None)
    budget.set_store_budget(client, first.bytes + 10)
    with pytest.raises(OverStorageBudget, match="over the storage budget"):
        extract("budgeted", 1, storage, redis_url, reference_server_url)
    budget.set_store_budget(client, None)
    assert extract("budgeted", 1, storage, redis_url, reference_server_url).status == "committed"


def test_submit_counts_what_is_stored_already(
    tmp_path: Path, tiny_model_dir: Path, redis_url: str, client: redis.Redis, reference_server_url: str
) -> None:
    storage = open_storage((tmp_path / "store").as_uri())
    first = plan(tmp_path, tiny_model_dir, redis_url, storage, job_id="first")
    run_all(first, storage, redis_url, reference_server_url)
    stored = budget.stored_bytes(client)
    assert stored == progress.job_progress(client, "first").bytes_stored > 0
    budget.set_store_budget(client, stored + first.projected_bytes // 2)
    with pytest.raises(OverBudget, match=r"GB is stored already"):
        plan(tmp_path, tiny_model_dir, redis_url, storage, job_id="second")
    deletion.delete_job("first", storage=storage, client=client)
    assert plan(tmp_path, tiny_model_dir, redis_url, storage, job_id="second").job_id == "second"


def test_concurrent_shards_never_reserve_past_the_budget(client: redis.Redis) -> None:
    job = make_job(shards=40)
    progress.register_job(client, job, "file:///tmp/x", EXTRACT)
    settings = Settings(storage_budget_bytes=10 * 1000)
    granted: list[int] = []
    lock = threading.Lock()

    def attempt(shard: int) -> None:
        try:
            budget.reserve(client, settings, job, shard, 1000)
        except OverStorageBudget:
            return
        with lock:
            granted.append(shard)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(attempt, range(40)))
    assert len(granted) == 10
    manifest: Manifest = make_manifest(granted[0], nbytes=1000)
    progress.record_commit(client, manifest)
    budget.release(client, job.job_id, granted[0])
    with pytest.raises(OverStorageBudget):  # its bytes are stored now instead of reserved
        budget.reserve(client, settings, job, 39, 1000)


def test_a_following_trainer_marks_the_job_until_it_stops(tmp_path: Path, client: redis.Redis) -> None:
    storage = open_storage((tmp_path / "store").as_uri())
    job = make_job()
    expected = TargetSignature((1, 3, 4), 64, 8, "LlamaForCausalLM")
    reading = ShardFollower(job, storage=storage, expected=expected)  # a trainer that does not follow: no mark
    assert reading.mark is None and followers.live_followers(client, job.job_id) == []
    follower = ShardFollower(job, storage=storage, expected=expected, redis_client=client, follow=True)
    assert follower.mark is not None
    assert followers.live_followers(client, job.job_id) == [follower.mark.name]
    assert 0 < client.ttl(followers.followers_key(job.job_id)) <= followers.FOLLOWER_TTL_S  # lapses by itself
    follower.mark.stop()
    assert followers.live_followers(client, job.job_id) == []
