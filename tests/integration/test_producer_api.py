"""The producer API in-process (FastAPI's TestClient) over a real Redis and real file storage; tasks are
collected instead of sent, so these tests see exactly what would be enqueued. The client sends the API token;
tests/integration/test_security.py covers what happens without it."""

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from services.producer.app import create_app
from services.producer.deps import get_enqueue
from shared.settings import Settings
from tests.datasets import BAD_LINES, write_dataset
from tests.fixtures.processes import free_port, wait_until

API_TOKEN = "producer-api-test-token-0123456789"


class Api:
    def __init__(self, client: TestClient, enqueued: list[tuple[str, int]], settings: Settings) -> None:
        self.client, self.enqueued, self.settings = client, enqueued, settings


def api_settings(tmp_path: Path, model_dir: Path, **fields: object) -> Settings:
    """A token, datasets under tmp_path and models next to the test model (shared/access.py)."""
    defaults: dict[str, object] = {
        "storage_url": (tmp_path / "store").as_uri(),
        "api_token": API_TOKEN,
        "dataset_roots": [str(tmp_path)],
        "model_roots": [model_dir.parent],
    }
    return Settings(**(defaults | fields))


def make_api(settings: Settings) -> Iterator[Api]:
    enqueued: list[tuple[str, int]] = []
    app = create_app(settings)
    app.dependency_overrides[get_enqueue] = lambda: lambda kind, job_id, shard: enqueued.append((job_id, shard))
    with TestClient(app, headers={"Authorization": f"Bearer {API_TOKEN}"}) as client:
        yield Api(client, enqueued, settings)


@pytest.fixture
def api(redis_url: str, tmp_path: Path, tiny_model_dir: Path) -> Iterator[Api]:
    yield from make_api(api_settings(tmp_path, tiny_model_dir, redis_url=redis_url))


def test_submit_plans_shards_and_reports_progress(api: Api, tiny_model_dir: Path, tmp_path: Path) -> None:
    dataset, bad_at = write_dataset(tmp_path / "data.jsonl")
    response = api.client.post(
        "/v1/jobs",
        json={
            "dataset_url": str(dataset),
            "model_path": str(tiny_model_dir),
            "shard_token_budget": 120,
            "max_length": 256,
            "length_policy": "reject",
        },
    )
    assert response.status_code == 201, response.text
    body = response.json()
    job, progress = body["job"], body["progress"]
    assert [shard for _, shard in api.enqueued] == list(range(job["shards_total"]))
    assert progress["state"] == "queued" and progress["samples_rejected"] == len(BAD_LINES)
    assert progress["tokens_total"] == job["tokens_total"] > 0 and progress["tokens_done"] == 0
    assert api.client.get(f"/v1/jobs/{job['job_id']}").json()["job"]["aux_layer_ids"] == [1, 3, 4]
    assert [p["job_id"] for p in api.client.get("/v1/jobs").json()] == [job["job_id"]]
    rejected = api.client.get(f"/v1/jobs/{job['job_id']}/rejected").json()
    assert sorted(r["line"] for r in rejected) == sorted(bad_at.values())
    assert api.client.post(f"/v1/jobs/{job['job_id']}/cancel").json()["state"] == "cancelled"


def test_upload_keeps_the_dataset_with_the_job(api: Api, tiny_model_dir: Path, tmp_path: Path) -> None:
    dataset, _ = write_dataset(tmp_path / "data.jsonl", with_bad_lines=False)
    response = api.client.post(
        "/v1/jobs/upload",
        files={"dataset": dataset.open("rb")},
        data={"spec": f'{{"model_path": "{tiny_model_dir}", "job_id": "uploaded"}}'},
    )
    assert response.status_code == 201, response.text
    assert response.json()["job"]["spec"]["dataset_url"].endswith("/uploaded/dataset.jsonl")
    assert (tmp_path / "store" / "uploaded" / "dataset.jsonl").read_bytes() == dataset.read_bytes()


@pytest.mark.parametrize(
    ("change", "status", "message"),
    [
        pytest.param({"dataset_url": "nowhere.jsonl"}, 422, "nowhere.jsonl not found", id="missing-dataset"),
        pytest.param({"model_path": "nowhere"}, 422, "nowhere not found (no config.json there)", id="missing-model"),
        pytest.param({"aux_layer_ids": [1, 2, 99]}, 422, "aux_layer_ids [1, 2, 99]", id="layer-out-of-range"),
    ],
)
def test_bad_submit_is_refused_and_nothing_is_enqueued(
    api: Api, tiny_model_dir: Path, tmp_path: Path, change: dict, status: int, message: str
) -> None:
    dataset, _ = write_dataset(tmp_path / "data.jsonl")
    spec = {"dataset_url": str(dataset), "model_path": str(tiny_model_dir), **change}
    # Missing files under the roots: a dataset next to the real one, a model next to the test model.
    if "dataset_url" in change:
        spec["dataset_url"] = str(tmp_path / change["dataset_url"])
    if "model_path" in change:
        spec["model_path"] = str(tiny_model_dir.parent / change["model_path"])
    response = api.client.post("/v1/jobs", json=spec)
    assert response.status_code == status and message in response.json()["detail"]
    assert api.enqueued == [] and api.client.get("/v1/jobs").json() == []


def test_an_unknown_field_in_a_submit_is_refused_by_name(api: Api, tiny_model_dir: Path, tmp_path: Path) -> None:
    """A typo is not ignored: the job it was meant for would be planned without what was asked."""
    dataset, _ = write_dataset(tmp_path / "data.jsonl")
    spec = {"dataset_url": str(dataset), "model_path": str(tiny_model_dir), "shard_token_budjet": 120}
    response = api.client.post("/v1/jobs", json=spec)
    assert response.status_code == 422
    assert [(e["loc"], e["type"]) for e in response.json()["detail"]] == [
        (["body", "shard_token_budjet"], "extra_forbidden")
    ]
    response = api.client.post(
        "/v1/jobs/upload",
        files={"dataset": dataset.open("rb")},
        data={"spec": f'{{"model_path": "{tiny_model_dir}", "shard_token_budjet": 120}}'},
    )
    assert response.status_code == 422
    assert "shard_token_budjet\n  not an option of jobs of kind 'extract'" in response.json()["detail"]
    assert api.enqueued == [] and api.client.get("/v1/jobs").json() == []


def test_job_over_the_storage_budget_is_refused_up_front(redis_url: str, tmp_path: Path, tiny_model_dir: Path) -> None:
    dataset, _ = write_dataset(tmp_path / "data.jsonl")
    settings = api_settings(tmp_path, tiny_model_dir, redis_url=redis_url, storage_budget_bytes=10_000)
    for api in make_api(settings):
        response = api.client.post("/v1/jobs", json={"dataset_url": str(dataset), "model_path": str(tiny_model_dir)})
        assert response.status_code == 413
        assert "storage budget is 0.00 GB" in response.json()["detail"]
        assert (api.enqueued == [] and not (tmp_path / "store").exists()) or not list((tmp_path / "store").iterdir())


def test_unreachable_redis_is_a_clear_503(tmp_path: Path, tiny_model_dir: Path) -> None:
    dataset, _ = write_dataset(tmp_path / "data.jsonl")
    settings = api_settings(tmp_path, tiny_model_dir, redis_url="redis://127.0.0.1:1/0")
    for api in make_api(settings):
        response = api.client.post("/v1/jobs", json={"dataset_url": str(dataset), "model_path": str(tiny_model_dir)})
        assert response.status_code == 503 and "Redis at redis://127.0.0.1:1/0 is not reachable" in response.text
        assert api.enqueued == []


def test_every_endpoint_answers_503_with_retry_after_while_redis_is_down(tmp_path: Path, tiny_model_dir: Path) -> None:
    port = free_port()
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    server = subprocess.Popen([*argv, "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        wait_until(lambda: redis.Redis.from_url(url).ping(), timeout_s=10)
        dataset, _ = write_dataset(tmp_path / "data.jsonl")
        for api in make_api(api_settings(tmp_path, tiny_model_dir, redis_url=url)):
            spec = {"dataset_url": str(dataset), "model_path": str(tiny_model_dir)}
            job_id = api.client.post("/v1/jobs", json=spec).json()["job"]["job_id"]
            server.terminate()  # a real Redis, stopped
            server.wait(timeout=10)
            requests = [
                ("GET", "/v1/jobs"),
                ("GET", f"/v1/jobs/{job_id}"),
                ("GET", f"/v1/jobs/{job_id}/progress"),
                ("GET", f"/v1/jobs/{job_id}/details"),
                ("GET", f"/v1/jobs/{job_id}/timeline"),
                ("GET", "/v1/overview"),
                ("GET", "/v1/cluster"),
                ("GET", "/metrics"),
                ("POST", f"/v1/jobs/{job_id}/cancel"),
                ("POST", f"/v1/jobs/{job_id}/resume"),
                ("POST", "/v1/jobs"),
            ]
            for method, path in requests:
                response = api.client.request(method, path, json=spec if path == "/v1/jobs" else None)
                assert response.status_code == 503, (method, path, response.status_code, response.text)
                assert response.headers["Retry-After"] == "5", (method, path)
                assert f"Redis at {url} is not reachable" in response.json()["detail"], (method, path)
            assert api.client.get("/health").status_code == 200  # the API itself is alive: it only waits for Redis
            server = subprocess.Popen([*argv, "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
            wait_until(lambda: redis.Redis.from_url(url).ping(), timeout_s=10)
            assert api.client.get("/v1/jobs").status_code == 200  # back without a restart of the API
    finally:
        server.kill()
        server.wait()


def test_unreachable_storage_is_a_clear_503(redis_url: str, tmp_path: Path, tiny_model_dir: Path) -> None:
    dataset, _ = write_dataset(tmp_path / "data.jsonl")
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the storage root should be")
    settings = api_settings(tmp_path, tiny_model_dir, redis_url=redis_url, storage_url=blocker.as_uri())
    for api in make_api(settings):
        response = api.client.post("/v1/jobs", json={"dataset_url": str(dataset), "model_path": str(tiny_model_dir)})
        assert response.status_code == 503 and "storage" in response.json()["detail"]
        assert api.enqueued == []


def test_metrics_dashboard_and_openapi_are_served(api: Api) -> None:
    assert api.client.get("/metrics").status_code == 200
    assert "EAGLE-3" in api.client.get("/dashboard").text
    schema = api.client.get("/openapi.json").json()
    assert "/v1/jobs" in schema["paths"]
    # The submit body lists every kind's own options beside the common fields, each saying which kinds take it.
    spec = schema["components"]["schemas"]["JobSpec"]["properties"]
    assert spec["max_new_tokens"]["description"].startswith("regenerate jobs: ")
    seed = spec["seed"]["description"]
    assert seed.startswith("regenerate jobs: ") and "; audit jobs: " in seed
    assert "max_length" in spec and "audit_fraction" in spec
    # A job's record likewise lists each kind's own fields, with the models they refer to.
    record = schema["components"]["schemas"]["JobRecord"]["properties"]
    assert record["regeneration"]["$ref"] == "#/components/schemas/RegenerationPlan"
    assert "assistant_turns_total" in schema["components"]["schemas"]["RegenerationPlan"]["properties"]
