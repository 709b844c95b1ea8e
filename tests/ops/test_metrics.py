"""/metrics after real jobs on the real stack: queue, workers, shard latency histogram, bytes written and failures
by reason agree with the API; every metric the provisioned Grafana dashboard queries exists."""

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.ops.conftest import OpsStack, RanJobs

pytestmark = pytest.mark.slow

GRAFANA_DASHBOARD = Path(__file__).resolve().parents[2] / "docker" / "grafana" / "dashboards" / "eagle3.json"


def _samples(ops_stack: OpsStack) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = ops_stack.api.get("/metrics").text
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def _one(samples: dict, name: str, **labels: str) -> float:
    matches = [v for found, v in samples[name] if all(found.get(k) == want for k, want in labels.items())]
    assert len(matches) == 1, (name, labels, samples.get(name))
    return matches[0]


def test_shard_metrics_agree_with_the_jobs(ops_stack: OpsStack, ran_jobs: RanJobs) -> None:
    jobs = ops_stack.api.get("/v1/jobs").json()
    for p in jobs:
        ops_stack.wait_finished(p["job_id"])
    jobs = ops_stack.api.get("/v1/jobs").json()
    samples = _samples(ops_stack)

    committed = sum(p["shards_committed"] for p in jobs)
    assert _one(samples, "eagle3_shard_duration_seconds_count", task="extract") == committed
    assert _one(samples, "eagle3_shard_duration_seconds_bucket", task="extract", le="+Inf") == committed
    assert _one(samples, "eagle3_shard_duration_seconds_sum", task="extract") > 0
    assert _one(samples, "eagle3_shard_bytes_written_total", task="extract") == sum(p["bytes_stored"] for p in jobs)
    assert _one(samples, "eagle3_shard_tokens_written_total", task="extract") == sum(p["tokens_done"] for p in jobs)
    dead = sum(p["shards_dead_lettered"] for p in jobs)
    assert dead > 0
    assert (
        _one(samples, "eagle3_shard_failures_total", task="extract", outcome="dead_lettered", reason="ModelMismatch")
        == dead
    )


def test_queue_and_worker_metrics(ops_stack: OpsStack, ran_jobs: RanJobs) -> None:
    samples = _samples(ops_stack)
    assert _one(samples, "eagle3_workers", state="alive") == 2
    assert _one(samples, "eagle3_queue_depth", queue="eagle3.extract") == 0
    assert _one(samples, "eagle3_queue_oldest_message_age_seconds", queue="eagle3.extract") == 0
    held = [v for _, v in samples["eagle3_worker_held_shards"]]
    assert len(held) == 2 and all(v == 0 for v in held)
    assert _one(samples, "eagle3_job_stalled", job_id=ran_jobs.clean) == 0


def test_storage_and_the_budget_set_while_running(ops_stack: OpsStack, ran_jobs: RanJobs) -> None:
    ops_stack.wait_finished(ran_jobs.clean)
    before = ops_stack.api.get("/v1/budget").json()["storage_budget_bytes"]
    assert ops_stack.api.put("/v1/budget", json={"storage_budget_bytes": 10**12}).status_code == 200
    try:
        samples = _samples(ops_stack)
        stored = ops_stack.api.get("/v1/budget").json()["stored_bytes"]
        assert stored > 0 and _one(samples, "eagle3_storage_stored_bytes") == stored
        assert _one(samples, "eagle3_storage_budget_bytes") == 10**12
    finally:
        ops_stack.api.put("/v1/budget", json={"storage_budget_bytes": before})


def test_every_metric_the_grafana_dashboard_queries_is_exported(ops_stack: OpsStack, ran_jobs: RanJobs) -> None:
    dashboard = json.loads(GRAFANA_DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    queried = {name for expr in exprs for name in re.findall(r"\beagle3_[a-z_]+", expr)}
    exported = set(_samples(ops_stack))
    assert len(queried) >= 10
    assert queried <= exported, f"queried but not exported: {sorted(queried - exported)}"
