"""The producer API closed by default, against the real app over real Redis and real file (or SeaweedFS S3) storage:
the token, dataset and model confinement, request size limits, job id validation, and secrets kept out of answers,
records and logs. Tasks are collected instead of sent, so each test sees exactly what would be enqueued."""

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis
from fastapi.testclient import TestClient

from services.producer.app import create_app
from services.producer.deps import get_enqueue
from shared import access
from shared.errors import ConfigurationError
from shared.settings import Settings
from tests.datasets import write_dataset
from tests.deploy.tools import REPO, compose, run
from tests.fixtures.processes import free_port, wait_until

TOKEN = "integration-test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
REDIS_PASSWORD = "redis-password-never-shown"


@dataclass
class Api:
    client: TestClient  # sends no token unless a test passes AUTH
    enqueued: list[tuple[str, int]]
    settings: Settings
    root: Path  # tmp: data/ (the dataset root), store/ (storage), secret/ (outside every root)

    @property
    def data(self) -> Path:
        return self.root / "data"

    def submit(self, dataset: Path, model: Path, **spec: object) -> httpx.Response:
        return self.client.post(
            "/v1/jobs", json={"dataset_url": str(dataset), "model_path": str(model), **spec}, headers=AUTH
        )


def make_settings(root: Path, redis_url: str, model_dir: Path, **fields: object) -> Settings:
    for name in ("data", "store", "secret"):
        (root / name).mkdir(exist_ok=True)
    (root / "secret" / "id_rsa").write_text("-----BEGIN PRIVATE KEY----- not for jobs\n")
    defaults: dict[str, object] = {
        "redis_url": redis_url,
        "storage_url": (root / "store").as_uri(),
        "home": root / "home",
        "api_token": TOKEN,
        "dataset_roots": [str(root / "data")],
        "model_roots": [model_dir],  # the test model's own folder: tmp_path and its siblings are outside
    }
    return Settings(_env_file=None, **(defaults | fields))


def serve(settings: Settings, root: Path) -> Iterator[Api]:
    enqueued: list[tuple[str, int]] = []
    app = create_app(settings)
    app.dependency_overrides[get_enqueue] = lambda: lambda kind, job_id, shard: enqueued.append((job_id, shard))
    with TestClient(app) as client:
        yield Api(client, enqueued, settings, root)


@pytest.fixture
def api(redis_url: str, tmp_path: Path, tiny_model_dir: Path) -> Iterator[Api]:
    yield from serve(make_settings(tmp_path, redis_url, tiny_model_dir), tmp_path)


@pytest.fixture
def job(api: Api, tiny_model_dir: Path) -> dict:
    dataset, _ = write_dataset(api.data / "chats.jsonl")
    response = api.submit(dataset, tiny_model_dir, shard_token_budget=200)
    assert response.status_code == 201, response.text
    return response.json()["job"]


# ----------------------------------------------------------------------------------------------------------
# The token


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param({}, id="no-token"),
        pytest.param({"Authorization": "Bearer wrong-token-0123456789"}, id="wrong-token"),
        pytest.param({"Authorization": f"Bearer {TOKEN}x"}, id="token-plus-one"),
        pytest.param({"Authorization": f"Bearer {TOKEN[:-1]}"}, id="token-minus-one"),
        pytest.param({"Authorization": f"Basic {TOKEN}"}, id="not-bearer"),
        pytest.param({"Authorization": TOKEN}, id="no-scheme"),
    ],
)
def test_requests_without_the_token_are_refused_and_change_nothing(
    api: Api, job: dict, tiny_model_dir: Path, headers: dict[str, str]
) -> None:
    job_id = job["job_id"]
    enqueued = list(api.enqueued)
    dataset, _ = write_dataset(api.data / "more.jsonl")
    refused = {
        "submit": api.client.post(
            "/v1/jobs", json={"dataset_url": str(dataset), "model_path": str(tiny_model_dir)}, headers=headers
        ),
        "upload": api.client.post(
            "/v1/jobs/upload",
            files={"dataset": dataset.read_bytes()},
            data={"spec": json.dumps({"model_path": str(tiny_model_dir), "job_id": "sneaky"})},
            headers=headers,
        ),
        "cancel": api.client.post(f"/v1/jobs/{job_id}/cancel", headers=headers),
        "resume": api.client.post(f"/v1/jobs/{job_id}/resume", headers=headers),
        "job record": api.client.get(f"/v1/jobs/{job_id}", headers=headers),
        "rejected": api.client.get(f"/v1/jobs/{job_id}/rejected", headers=headers),
        "failed": api.client.get(f"/v1/jobs/{job_id}/failed", headers=headers),
    }
    for name, response in refused.items():
        assert response.status_code == 401, f"{name}: {response.status_code} {response.text}"
        assert response.headers["www-authenticate"] == "Bearer"
        assert "missing or wrong bearer token" in response.json()["detail"]
    assert api.enqueued == enqueued
    assert not (api.root / "store" / "sneaky").exists()
    listed = api.client.get("/v1/jobs").json()
    assert [(p["job_id"], p["state"]) for p in listed] == [(job_id, "queued")]  # not cancelled


def test_the_token_opens_every_endpoint(api: Api, job: dict) -> None:
    job_id = job["job_id"]
    for path in (f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/rejected", f"/v1/jobs/{job_id}/failed"):
        assert api.client.get(path, headers=AUTH).status_code == 200, path
    assert api.client.post(f"/v1/jobs/{job_id}/cancel", headers=AUTH).json()["state"] == "cancelled"
    assert api.client.post(f"/v1/jobs/{job_id}/resume", headers=AUTH).status_code == 200


def test_progress_numbers_stay_open_without_paths(api: Api, job: dict) -> None:
    # The same numbers as /metrics, which Prometheus scrapes without credentials; no path or spec in them.
    listed = api.client.get("/v1/jobs")
    assert listed.status_code == 200 and [p["job_id"] for p in listed.json()] == [job["job_id"]]
    assert str(api.root) not in listed.text
    one = api.client.get(f"/v1/jobs/{job['job_id']}/progress")
    assert one.status_code == 200 and one.json()["tokens_total"] == job["tokens_total"]
    for path in ("/health", "/metrics", "/dashboard", "/openapi.json"):
        assert api.client.get(path).status_code == 200, path


def test_auth_off_on_loopback_takes_requests_without_a_token(
    redis_url: str, tmp_path: Path, tiny_model_dir: Path
) -> None:
    settings = make_settings(tmp_path, redis_url, tiny_model_dir, api_token=None, api_auth="off")
    for api in serve(settings, tmp_path):
        dataset, _ = write_dataset(api.data / "chats.jsonl")
        response = api.client.post("/v1/jobs", json={"dataset_url": str(dataset), "model_path": str(tiny_model_dir)})
        assert response.status_code == 201, response.text
        assert api.client.post(f"/v1/jobs/{response.json()['job']['job_id']}/cancel").status_code == 200


def test_the_app_is_not_built_open(redis_url: str, tmp_path: Path, tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigurationError, match="EAGLE3_API_TOKEN is not set"):
        create_app(make_settings(tmp_path, redis_url, tiny_model_dir, api_token=None))


@pytest.mark.slow  # a process per case
@pytest.mark.parametrize(
    ("env", "message"),
    [
        pytest.param({}, "EAGLE3_API_TOKEN is not set, and the API does not start open", id="no-token"),
        pytest.param({"EAGLE3_API_TOKEN": "changethis"}, "an example value", id="example-token"),
        pytest.param({"EAGLE3_API_TOKEN": ""}, "EAGLE3_API_TOKEN is empty", id="empty-token"),
        pytest.param(
            {"EAGLE3_API_AUTH": "off", "EAGLE3_API_HOST": "0.0.0.0"},
            "EAGLE3_API_AUTH=off is accepted only when the API listens on a loopback address",
            id="auth-off-on-all-interfaces",
        ),
    ],
)
def test_eagle3_api_refuses_to_start_open(tmp_path: Path, env: dict[str, str], message: str) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("EAGLE3_")}
    result = subprocess.run(
        [sys.executable, "-m", "eagle3", "api"],
        env={**clean, "EAGLE3_HOME": str(tmp_path), "EAGLE3_API_PORT": str(free_port()), **env},
        cwd=tmp_path,  # no .env of the checkout
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert message in result.stderr, result.stderr[-2000:]


# ----------------------------------------------------------------------------------------------------------
# Datasets and models


@pytest.mark.parametrize(
    ("where", "rule"),
    [
        pytest.param(lambda root: str(root / "secret" / "id_rsa"), "is outside the dataset roots", id="outside"),
        pytest.param(
            lambda root: str(root / "data" / ".." / "secret" / "id_rsa"), "is outside the dataset roots", id="dot-dot"
        ),
        pytest.param(lambda root: str(root / "data" / "link" / "id_rsa"), "is outside the dataset roots", id="symlink"),
        pytest.param(lambda root: (root / "secret" / "id_rsa").as_uri(), "is outside the dataset roots", id="file-url"),
        pytest.param(lambda root: "/etc/passwd", "is outside the dataset roots", id="etc-passwd"),
        pytest.param(lambda root: "file://evil.example/etc/passwd", "a file:// URL names a local path", id="file-host"),
        pytest.param(lambda root: "http://169.254.169.254/latest/meta-data", "unsupported scheme", id="http"),
        pytest.param(lambda root: "s3://someone-else/data.jsonl", "must be in the storage bucket", id="s3-bucket"),
    ],
)
def test_datasets_outside_the_roots_are_a_422_naming_the_rule(
    api: Api, tiny_model_dir: Path, where: Callable[[Path], str], rule: str
) -> None:
    (api.data / "link").symlink_to(api.root / "secret")
    response = api.submit(where(api.root), tiny_model_dir)
    assert response.status_code == 422, response.text
    assert rule in response.json()["detail"]
    assert "PRIVATE KEY" not in response.text
    assert api.enqueued == [] and api.client.get("/v1/jobs").json() == []


def test_without_dataset_roots_local_paths_are_refused_and_uploads_work(
    redis_url: str, tmp_path: Path, tiny_model_dir: Path
) -> None:
    settings = make_settings(tmp_path, redis_url, tiny_model_dir, dataset_roots=[])
    for api in serve(settings, tmp_path):
        dataset, _ = write_dataset(api.data / "chats.jsonl")
        refused = api.submit(dataset, tiny_model_dir)
        assert refused.status_code == 422 and "EAGLE3_DATASET_ROOTS" in refused.json()["detail"]
        assert "--upload" in refused.json()["detail"]
        uploaded = api.client.post(
            "/v1/jobs/upload",
            files={"dataset": dataset.read_bytes()},
            data={"spec": json.dumps({"model_path": str(tiny_model_dir)})},
            headers=AUTH,
        )
        assert uploaded.status_code == 201, uploaded.text


def test_models_outside_the_model_roots_are_a_422(api: Api, tiny_model_dir: Path) -> None:
    dataset, _ = write_dataset(api.data / "chats.jsonl")
    for model in (api.root / "secret", tiny_model_dir.parent.parent, Path("/")):
        response = api.submit(dataset, model)
        assert response.status_code == 422, response.text
        assert "is outside the model roots" in response.json()["detail"]
    assert api.enqueued == []


def test_default_model_roots_are_the_configured_models_parent(
    redis_url: str, tmp_path: Path, tiny_model_dir: Path
) -> None:
    settings = make_settings(tmp_path, redis_url, tiny_model_dir, model_roots=None, model_path=tiny_model_dir)
    for api in serve(settings, tmp_path):
        dataset, _ = write_dataset(api.data / "chats.jsonl")
        response = api.client.post("/v1/jobs", json={"dataset_url": str(dataset)}, headers=AUTH)
        assert response.status_code == 201, response.text
        refused = api.submit(dataset, Path("/usr"))
        assert refused.status_code == 422 and "is outside the model roots" in refused.json()["detail"]


def test_a_regenerate_output_outside_the_roots_is_a_422(api: Api, tiny_model_dir: Path) -> None:
    dataset, _ = write_dataset(api.data / "chats.jsonl", with_bad_lines=False)
    target = api.root / "secret" / "authorized_keys"
    response = api.submit(dataset, tiny_model_dir, kind="regenerate", output_url=str(target))
    assert response.status_code == 422 and "output_url" in response.json()["detail"]
    assert not target.exists() and api.enqueued == []


def test_s3_datasets_only_from_the_storage_bucket(
    s3_server, redis_url: str, tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in s3_server.env().items():
        if name.startswith("AWS_"):
            monkeypatch.setenv(name, value)
    settings = make_settings(
        tmp_path,
        redis_url,
        tiny_model_dir,
        storage_url=s3_server.storage_url("security-test"),
        s3_endpoint_url=s3_server.endpoint_url,
    )
    dataset, _ = write_dataset(tmp_path / "chats.jsonl")
    s3_server.client().put_object(Bucket=s3_server.bucket, Key="datasets/chats.jsonl", Body=dataset.read_bytes())
    for api in serve(settings, tmp_path):
        accepted = api.client.post(
            "/v1/jobs",
            json={"dataset_url": f"s3://{s3_server.bucket}/datasets/chats.jsonl", "model_path": str(tiny_model_dir)},
            headers=AUTH,
        )
        assert accepted.status_code == 201, accepted.text
        refused = api.client.post(
            "/v1/jobs",
            json={"dataset_url": "s3://another-bucket/datasets/chats.jsonl", "model_path": str(tiny_model_dir)},
            headers=AUTH,
        )
        assert refused.status_code == 422 and "must be in the storage bucket" in refused.json()["detail"]


# ----------------------------------------------------------------------------------------------------------
# Request size limits


def test_a_json_body_over_the_limit_is_a_413(redis_url: str, tmp_path: Path, tiny_model_dir: Path) -> None:
    settings = make_settings(tmp_path, redis_url, tiny_model_dir, api_max_request_bytes=2048)
    for api in serve(settings, tmp_path):
        spec = {"dataset_url": "x" * 4096, "model_path": str(tiny_model_dir)}
        response = api.client.post("/v1/jobs", json=spec, headers=AUTH)
        assert response.status_code == 413
        assert response.json()["detail"] == "request body over 2048 bytes (EAGLE3_API_MAX_REQUEST_BYTES)"

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
            yield b'{"dataset_url": "'
            for _ in range(8):
                yield b"x" * 512
            yield b'"}'

        chunked = api.client.post("/v1/jobs", content=chunks(), headers={**AUTH, "Content-Type": "application/json"})
        assert chunked.status_code == 413 and "EAGLE3_API_MAX_REQUEST_BYTES" in chunked.text
        assert api.enqueued == []


def test_the_default_request_limit_is_one_mebibyte(api: Api, tiny_model_dir: Path) -> None:
    assert api.settings.api_max_request_bytes == 1024 * 1024
    response = api.client.post(
        "/v1/jobs", json={"dataset_url": "x" * (1024 * 1024), "model_path": str(tiny_model_dir)}, headers=AUTH
    )
    assert response.status_code == 413 and "over 1048576 bytes" in response.json()["detail"]


def test_an_upload_over_its_limit_is_a_413_and_nothing_is_stored(
    redis_url: str, tmp_path: Path, tiny_model_dir: Path
) -> None:
    settings = make_settings(tmp_path, redis_url, tiny_model_dir, api_max_upload_bytes=4096)
    for api in serve(settings, tmp_path):
        dataset, _ = write_dataset(api.data / "chats.jsonl", repeat=4)
        assert dataset.stat().st_size > 4096
        response = api.client.post(
            "/v1/jobs/upload",
            files={"dataset": dataset.read_bytes()},
            data={"spec": json.dumps({"model_path": str(tiny_model_dir), "job_id": "too-big"})},
            headers=AUTH,
        )
        assert response.status_code == 413
        assert response.json()["detail"] == "request body over 4096 bytes (EAGLE3_API_MAX_UPLOAD_BYTES)"
        assert not (api.root / "store" / "too-big").exists() and api.enqueued == []


def test_uploads_default_to_their_own_larger_limit(api: Api, tiny_model_dir: Path) -> None:
    assert api.settings.api_max_upload_bytes == 1024**3
    dataset, _ = write_dataset(api.data / "chats.jsonl", with_bad_lines=False, repeat=800)
    assert dataset.stat().st_size > api.settings.api_max_request_bytes  # over the JSON limit, under the upload one
    response = api.client.post(
        "/v1/jobs/upload",
        files={"dataset": dataset.read_bytes()},
        data={"spec": json.dumps({"model_path": str(tiny_model_dir), "shard_token_budget": 100000})},
        headers=AUTH,
    )
    assert response.status_code == 201, response.text[:500]


# ----------------------------------------------------------------------------------------------------------
# Job ids


@pytest.mark.parametrize("job_id", ["../escape", "a/b", "..", ".hidden", "x" * 65, "a b", "job\n"])
def test_a_client_chosen_job_id_must_match_the_pattern(api: Api, tiny_model_dir: Path, job_id: str) -> None:
    dataset, _ = write_dataset(api.data / "chats.jsonl")
    assert api.submit(dataset, tiny_model_dir, job_id=job_id).status_code == 422
    upload = api.client.post(
        "/v1/jobs/upload",
        files={"dataset": dataset.read_bytes()},
        data={"spec": json.dumps({"model_path": str(tiny_model_dir), "job_id": job_id})},
        headers=AUTH,
    )
    assert upload.status_code == 422 and "job_id" in upload.text
    assert api.enqueued == [] and list((api.root / "store").iterdir()) == []
    assert not (api.root / "escape").exists()


@pytest.mark.parametrize("raw", ["%2E%2E", ".hidden", "-x", "a%20b", "x" * 65, "job%0A"])
def test_a_job_id_in_the_path_that_cannot_exist_is_a_404(api: Api, job: dict, redis_url: str, raw: str) -> None:
    keys = set(redis.Redis.from_url(redis_url).keys())
    for method, path in [
        ("GET", f"/v1/jobs/{raw}"),
        ("GET", f"/v1/jobs/{raw}/progress"),
        ("GET", f"/v1/jobs/{raw}/rejected"),
        ("GET", f"/v1/jobs/{raw}/failed"),
        ("POST", f"/v1/jobs/{raw}/cancel"),
        ("POST", f"/v1/jobs/{raw}/resume"),
        ("GET", f"/v1/jobs/{raw}/details"),
        ("GET", f"/v1/jobs/{raw}/timeline"),
        ("GET", f"/v1/jobs/{raw}/trainer/run/curves"),
    ]:
        response = api.client.request(method, path, headers=AUTH)
        assert response.status_code == 404, f"{method} {path}: {response.status_code} {response.text}"
        assert "not a valid job id" in response.json()["detail"]
    assert set(redis.Redis.from_url(redis_url).keys()) == keys


def test_a_job_that_does_not_exist_gets_one_answer_on_every_route(api: Api, job: dict, redis_url: str) -> None:
    """The domain's JobNotFound, mapped to HTTP in one place (services/producer/errors.py): the same 404 and
    the same words whether the job is read, listed in part, cancelled, resumed or charted; nothing is written."""
    keys = set(redis.Redis.from_url(redis_url).keys())
    answers = set()
    for method, path in [
        ("GET", "/v1/jobs/job-none"),
        ("GET", "/v1/jobs/job-none/progress"),
        ("GET", "/v1/jobs/job-none/rejected"),
        ("GET", "/v1/jobs/job-none/failed"),
        ("GET", "/v1/jobs/job-none/audit"),
        ("POST", "/v1/jobs/job-none/cancel"),
        ("POST", "/v1/jobs/job-none/resume"),
        ("GET", "/v1/jobs/job-none/details"),
        ("GET", "/v1/jobs/job-none/timeline"),
    ]:
        response = api.client.request(method, path, headers=AUTH)
        assert response.status_code == 404, f"{method} {path}: {response.status_code} {response.text}"
        answers.add(response.json()["detail"])
    assert answers == {"job 'job-none' not found"}
    assert set(redis.Redis.from_url(redis_url).keys()) == keys
    assert not (api.root / "store" / "job-none").exists()


def test_an_upload_never_replaces_an_existing_jobs_dataset(api: Api, tiny_model_dir: Path) -> None:
    dataset, _ = write_dataset(api.data / "chats.jsonl", with_bad_lines=False)
    spec = json.dumps({"model_path": str(tiny_model_dir), "job_id": "kept"})
    first = api.client.post(
        "/v1/jobs/upload", files={"dataset": dataset.read_bytes()}, data={"spec": spec}, headers=AUTH
    )
    assert first.status_code == 201, first.text
    second = api.client.post("/v1/jobs/upload", files={"dataset": b"{}\n"}, data={"spec": spec}, headers=AUTH)
    assert second.status_code == 409 and "job kept already exists" in second.json()["detail"]
    assert (api.root / "store" / "kept" / "dataset.jsonl").read_bytes() == dataset.read_bytes()


# ----------------------------------------------------------------------------------------------------------
# Secrets


@pytest.fixture(scope="module")
def redis_with_password(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--requirepass", REDIS_PASSWORD, "--dir", str(tmp_path_factory.mktemp("redis-auth"))],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{port}/0"
    try:
        wait_until(lambda: redis.Redis.from_url(url).ping(), timeout_s=10)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_no_secret_in_answers_records_or_logs(
    redis_with_password: str, tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    settings = make_settings(tmp_path, redis_with_password, tiny_model_dir)
    answers: list[str] = []
    for api in serve(settings, tmp_path):
        dataset, _ = write_dataset(api.data / "chats.jsonl")
        submitted = api.submit(dataset, tiny_model_dir)
        assert submitted.status_code == 201, submitted.text
        job_id = submitted.json()["job"]["job_id"]
        answers += [submitted.text, api.client.post("/v1/jobs", json={}, headers={"Authorization": "Bearer x"}).text]
        for path in (f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/rejected", "/v1/jobs"):
            answers.append(api.client.get(path, headers=AUTH).text)
        answers += [api.client.get("/metrics").text, api.client.post(f"/v1/jobs/{job_id}/cancel", headers=AUTH).text]
        credentials = api.submit(f"s3://AKIAIOSFODNN7:{REDIS_PASSWORD}@bucket/x.jsonl", tiny_model_dir)
        assert credentials.status_code == 422 and "credentials in a URL are refused" in credentials.text
        answers.append(credentials.text)
    stored = [p.read_text() for p in (tmp_path / "store").rglob("*.json*")]
    client = redis.Redis.from_url(redis_with_password)
    progress_hash = {
        k.decode(): v.decode(errors="replace")
        for key in client.keys("*")
        if client.type(key) == b"hash"
        for k, v in client.hgetall(key).items()
    }
    assert stored and progress_hash
    seen = {
        "answers": "\n".join(answers),
        "storage": "\n".join(stored),
        "redis": json.dumps(progress_hash),
        "logs": caplog.text,
        "settings": repr(settings),
    }
    for where, text in seen.items():
        assert TOKEN not in text, f"the API token in {where}"
        assert REDIS_PASSWORD not in text, f"the Redis password in {where}"


def test_an_unreachable_redis_is_named_without_its_password(
    tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    settings = make_settings(tmp_path, f"redis://:{REDIS_PASSWORD}@127.0.0.1:1/0", tiny_model_dir)
    for api in serve(settings, tmp_path):
        dataset, _ = write_dataset(api.data / "chats.jsonl")
        response = api.submit(dataset, tiny_model_dir)
        assert response.status_code == 503
        assert "Redis at redis://***@127.0.0.1:1/0 is not reachable" in response.json()["detail"]
    assert REDIS_PASSWORD not in response.text and REDIS_PASSWORD not in caplog.text


# ----------------------------------------------------------------------------------------------------------
# The real processes: `eagle3 api` and the CLI client


@pytest.fixture(scope="module")
def api_process(
    redis_server: str, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[tuple[dict[str, str], Path]]:
    """`eagle3 api` with a token, on a free port; yields the environment a CLI needs (without the token)."""
    root = tmp_path_factory.mktemp("api-process")
    (root / "data").mkdir()
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("EAGLE3_")},
        "EAGLE3_HOME": str(root / "home"),
        "EAGLE3_REDIS_URL": redis_server,
        "EAGLE3_STORAGE_URL": (root / "store").as_uri(),
        "EAGLE3_API_PORT": str(port),
        "EAGLE3_API_URL": f"http://127.0.0.1:{port}",
        "EAGLE3_DATASET_ROOTS": str(root / "data"),
        "EAGLE3_MODEL_ROOTS": str(tiny_model_dir.parent),
    }
    log = root / "api.log"
    with log.open("wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "eagle3", "api"],
            env={**env, "EAGLE3_API_TOKEN": TOKEN},
            cwd=root,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200, timeout_s=120)
        yield env, root
    finally:
        server.terminate()
        server.wait(timeout=30)
        redis.Redis.from_url(redis_server).flushdb()  # the jobs it took, as the redis_url fixture does
    assert TOKEN not in log.read_text(), "the API token in the producer's log"


def eagle3(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "eagle3", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow  # a producer process and CLI processes
def test_the_cli_sends_the_token_and_shows_refusals(
    api_process: tuple[dict[str, str], Path], tiny_model_dir: Path
) -> None:
    env, root = api_process
    dataset, _ = write_dataset(root / "data" / "chats.jsonl")
    model = ["--model", str(tiny_model_dir)]

    anonymous = eagle3(env, root, "submit", str(dataset), *model)
    assert anonymous.returncode != 0 and "error 401: missing or wrong bearer token" in anonymous.stderr

    with_token = eagle3({**env, "EAGLE3_API_TOKEN": TOKEN}, root, "submit", str(dataset), *model, "--job-id", "cli-1")
    assert with_token.returncode == 0, with_token.stderr
    assert "submitted cli-1" in with_token.stdout

    outside = eagle3({**env, "EAGLE3_API_TOKEN": TOKEN}, root, "submit", str(root / "api.log"), *model)
    assert outside.returncode != 0 and "is outside the dataset roots" in outside.stderr

    # `eagle3 up` leaves its session token for the CLI, for its own API URL only.
    settings = Settings(_env_file=None, home=Path(env["EAGLE3_HOME"]), api_url=env["EAGLE3_API_URL"])
    access.write_session_token(settings, env["EAGLE3_API_URL"], TOKEN)
    cancelled = eagle3(env, root, "cancel", "cli-1")
    assert cancelled.returncode == 0 and "cancelled" in cancelled.stdout, cancelled.stderr
    access.write_session_token(settings, "http://127.0.0.1:1", TOKEN)
    elsewhere = eagle3(env, root, "resume", "cli-1")
    assert elsewhere.returncode != 0 and "error 401" in elsewhere.stderr


# ----------------------------------------------------------------------------------------------------------
# docker compose


def test_compose_refuses_to_start_without_a_token(tmp_path: Path) -> None:
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path)}
    env_example = REPO / ".env.example"
    for args, env in [((), base), (("--env-file", str(env_example)), base), ((), {**base, "EAGLE3_API_TOKEN": ""})]:
        result = run(compose(*args, "config", "-q", profiles=("cpu",)), env=env)
        assert result.returncode != 0, f"{args} {env.keys()}: compose started without a token"
        assert "set EAGLE3_API_TOKEN in .env" in result.stderr, result.stderr
    ok = run(compose("config", "--format", "json", profiles=("cpu",)), env={**base, "EAGLE3_API_TOKEN": TOKEN})
    assert ok.returncode == 0, ok.stderr
    producer = json.loads(ok.stdout)["services"]["producer"]
    assert producer["environment"]["EAGLE3_API_TOKEN"] == TOKEN
