"""The whole pipeline over real processes: redis-server, a SeaweedFS S3 server, the reference inference
server with a real (tiny random) Llama, two Celery worker processes and the producer API."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from celery import Celery

from shared.data.datasets import Conversation, read_dataset
from shared.data.tokenization import ChatTokenizer
from shared.data.vocab import load_vocab_mapping
from shared.errors import InvalidSample
from shared.lifecycle import progress
from shared.lifecycle.jobs import load_shard_input
from shared.lifecycle.queue import SHARD_QUEUE, task_name
from shared.lifecycle.shards import load_job
from shared.storage import layout
from shared.storage.sample_format import decode_sample, encode_sample
from tests.datasets import BAD_LINES, write_dataset
from tests.e2e.deployment import Deployment
from tests.fixtures.processes import broker_drained, wait_until
from tests.reference_checks import HFReference, assert_matches_layers

pytestmark = pytest.mark.slow


def test_job_commits_exact_tensors_masks_and_manifests(
    deployment: Deployment, tiny_model_dir: Path, tmp_path: Path
) -> None:
    dataset, bad_at = write_dataset(tmp_path / "data.jsonl")
    job = deployment.submit(
        dataset, max_length=256, length_policy="reject", shard_token_budget=200, draft_vocab_size=64
    )
    p = deployment.wait(job["job_id"])
    storage = deployment.storage

    assert p.state == "completed", p
    assert p.samples_rejected == len(BAD_LINES)
    rejected = deployment.api.get(f"/v1/jobs/{job['job_id']}/rejected").json()
    assert {r["line"] for r in rejected} == set(bad_at.values())
    assert all(r["reason"] and r["field"] for r in rejected)

    record = load_job(storage, job["job_id"])
    assert record.aux_layer_ids == [1, 3, 4] and record.hidden_size == 64
    mapping = load_vocab_mapping(storage.get(layout.vocab_mapping(job["job_id"])))
    assert mapping.d2t.shape == (64,) and int(mapping.t2d.sum()) == 64

    manifests = deployment.manifests(job["job_id"])
    assert len(manifests) == record.shards_total > 1
    samples = [s for m in manifests for s in m.samples]
    assert sorted(s.sample_index for s in samples) == list(range(record.samples_total))

    tokenizer = ChatTokenizer.from_pretrained(tiny_model_dir)
    expected = {}
    for item in read_dataset(dataset.read_text().splitlines()):
        if isinstance(item, Conversation):
            try:
                expected[item.sample_id] = tokenizer.tokenize(item, max_length=256, length_policy="reject")
            except InvalidSample:
                continue
    reference = HFReference(tiny_model_dir)
    for s in samples:
        data = storage.get(s.key)
        assert len(data) == s.bytes and hashlib.sha256(data).hexdigest() == s.sha256
        stored = decode_sample(data)
        assert stored["input_ids"].tolist() == expected[s.sample_id].input_ids
        assert stored["loss_mask"].tolist() == expected[s.sample_id].loss_mask
        assert_matches_layers(stored, reference, record.aux_layer_ids)

    assert p.samples_done == record.samples_total == len(samples)
    assert p.tokens_done == record.tokens_total == sum(m.num_tokens for m in manifests)
    assert p.bytes_stored == sum(m.bytes for m in manifests) == sum(s.bytes for s in samples)
    assert deployment.api.get(f"/v1/jobs/{job['job_id']}").json()["progress"]["tokens_done"] == p.tokens_done
    metrics = deployment.api.get("/metrics").text
    assert f'eagle3_job_tokens_done{{job_id="{job["job_id"]}",state="completed"}} {float(p.tokens_done)}' in metrics


def test_duplicate_deliveries_commit_each_shard_once(deployment: Deployment, tmp_path: Path) -> None:
    dataset, _ = write_dataset(tmp_path / "data.jsonl", with_bad_lines=False, repeat=2)
    job = deployment.submit(dataset, shard_token_budget=150)
    sender = Celery(broker=deployment.settings.redis_url)
    for shard_index in range(job["shards_total"]):  # every shard delivered a second time, concurrently
        sender.send_task(task_name("extract"), args=[job["job_id"], shard_index], queue=SHARD_QUEUE)
    deployment.wait(job["job_id"])
    wait_until(lambda: broker_drained(deployment.redis), timeout_s=120)  # the duplicates ran and were acked too
    p = progress.job_progress(deployment.redis, job["job_id"])
    manifests = deployment.manifests(job["job_id"])
    assert len(manifests) == job["shards_total"]
    keys = [s.key for m in manifests for s in m.samples]
    assert len(keys) == len(set(keys)) == job["samples_total"]
    for m in manifests:
        for s in m.samples:
            assert hashlib.sha256(deployment.storage.get(s.key)).hexdigest() == s.sha256
    assert (p.state, p.tokens_done, p.samples_done) == ("completed", job["tokens_total"], job["samples_total"])


def test_killed_workers_shards_are_redelivered_and_committed_once(deployment: Deployment, tmp_path: Path) -> None:
    dataset, _ = write_dataset(tmp_path / "data.jsonl", with_bad_lines=False, repeat=6)
    job = deployment.submit(dataset, shard_token_budget=400)
    job_id, storage = job["job_id"], deployment.storage

    record = load_job(storage, job_id)
    shard_of = {
        s.sample_index: k for k in range(record.shards_total) for s in load_shard_input(storage, record, k).samples
    }

    def mid_shard() -> bool:
        committed = {layout.shard_index_from_manifest_key(k) for k in storage.list(layout.manifests_prefix(job_id))}
        started = {int(k.rsplit("data_", 1)[1].removesuffix(".pt")) for k in storage.list(f"{job_id}/rows_")}
        return any(shard_of[i] not in committed for i in started)

    deadline = time.monotonic() + 60
    while not mid_shard():
        assert time.monotonic() < deadline, "never saw a shard in progress"
        time.sleep(0.02)
    for name, process in deployment.stack.processes:
        if name.startswith("worker-"):
            os.killpg(process.pid, signal.SIGKILL)  # the whole worker, pool children included: a pod dies
    deployment.stack.processes = [(n, p) for n, p in deployment.stack.processes if not n.startswith("worker-")]
    for _ in range(2):
        deployment.stack.add_worker()

    p = deployment.wait(job_id, timeout_s=240)
    manifests = deployment.manifests(job_id)
    indices = [s.sample_index for m in manifests for s in m.samples]
    assert sorted(indices) == list(range(job["samples_total"]))  # every sample present, once
    assert (p.state, p.tokens_done, p.shards_committed) == ("completed", job["tokens_total"], job["shards_total"])


def test_dead_inference_server_dead_letters_then_resume_completes(deployment: Deployment, tmp_path: Path) -> None:
    dataset, _ = write_dataset(tmp_path / "data.jsonl", with_bad_lines=False)
    inference = dict(deployment.stack.processes)["inference"]
    os.killpg(inference.pid, signal.SIGKILL)
    inference.wait()
    deployment.stack.processes = [(n, p) for n, p in deployment.stack.processes if n != "inference"]
    job = deployment.submit(dataset, shard_token_budget=300)
    p = deployment.wait(job["job_id"], timeout_s=120)
    assert p.state == "completed_with_errors" and p.shards_dead_lettered == job["shards_total"]
    assert p.samples_failed == job["samples_total"] and p.tokens_failed == job["tokens_total"]
    letters = deployment.storage.list(layout.dead_letter_prefix(job["job_id"]))
    assert len(letters) == job["shards_total"]
    letter = deployment.storage.get(letters[0]).decode()
    assert "InferenceUnavailable" in letter and deployment.stack.env["EAGLE3_INFERENCE_URL"] in letter
    assert not deployment.storage.list(layout.manifests_prefix(job["job_id"]))

    deployment.stack.start_inference()
    assert deployment.api.post(f"/v1/jobs/{job['job_id']}/resume").status_code == 200
    p = deployment.wait(job["job_id"])
    assert (p.state, p.shards_dead_lettered, p.samples_failed, p.tokens_done) == (
        "completed",
        0,
        0,
        job["tokens_total"],
    )
    assert not deployment.storage.list(layout.dead_letter_prefix(job["job_id"]))


def test_the_real_api_is_closed_and_no_secret_reaches_a_log(deployment: Deployment, s3_server) -> None:
    # Last in this module: the logs hold every request, task and shard of the tests above.
    anonymous = httpx.post(f"{deployment.stack.api_url}/v1/jobs", json={"dataset_url": "/etc/passwd"}, timeout=30)
    assert anonymous.status_code == 401
    token = deployment.stack.api_token
    assert token is not None
    logs = sorted((deployment.settings.home / "logs").glob("*.log"))
    assert {p.stem for p in logs} >= {"producer", "worker-1", "worker-2", "inference"}
    for log in logs:
        text = log.read_text(errors="replace")
        assert token not in text, f"the API token in {log}"
        assert s3_server.secret_key not in text, f"the S3 secret key in {log}"


def test_eagle3_audit_passes_a_clean_job_flags_a_corrupted_one_and_the_trainer_warns(
    deployment: Deployment, tmp_path: Path
) -> None:
    """`eagle3 audit` over the real stack (the producer plans it, a worker recomputes through the reference server):
    the clean job passes; after one committed sample's final state is replaced (its manifest rewritten to match, so
    only the recomputation can tell) it fails naming that sample, exits 1, and the trainer warns or refuses."""
    dataset, _ = write_dataset(tmp_path / "data.jsonl", with_bad_lines=False)
    job = deployment.submit(dataset, max_length=256, shard_token_budget=200, draft_vocab_size=64)
    assert deployment.wait(job["job_id"]).state == "completed"
    env = {**os.environ, **deployment.stack.env, "EAGLE3_HOME": str(tmp_path / "cli-home")}

    def audit(*flags: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "eagle3", "audit", job["job_id"], "--fraction", "1", "--json", *flags]
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)

    clean = audit()
    assert clean.returncode == 0, clean.stderr[-2000:]
    report = json.loads(clean.stdout)
    assert report["passed"] and report["samples_checked"] == job["samples_total"]
    # the reference server extracted and recomputed: the table says that is no check of the server itself
    assert report["source_backend"]["backend"] == report["backend"]["backend"] == "reference"
    assert report["independent"] is False

    manifest = deployment.manifests(job["job_id"])[0]
    entry = manifest.samples[0]
    record = decode_sample(deployment.storage.get(entry.key))
    final = torch.roll(record["hidden_state"][0], shifts=1, dims=0)  # every token gets its neighbour's state
    data = encode_sample(
        record["input_ids"].tolist(), record["loss_mask"].tolist(), record["aux_hidden_state"][0], final
    )
    deployment.storage.put(entry.key, data)
    entry.bytes, entry.sha256 = len(data), hashlib.sha256(data).hexdigest()
    deployment.storage.put(layout.manifest(job["job_id"], manifest.shard_index), manifest.model_dump_json().encode())

    corrupted = audit()
    assert corrupted.returncode == 1 and "audit of" in corrupted.stderr
    report = json.loads(corrupted.stdout)
    (failure,) = report["failures"]
    assert failure["sample_id"] == entry.sample_id and "final state: relative error" in failure["reasons"][0]
    assert deployment.api.get(f"/v1/jobs/{job['job_id']}/audit").json()["passed"] is False
    verdict = deployment.api.get(f"/v1/jobs/{job['job_id']}").json()["audit"]  # the job's record carries it
    assert (verdict["audit_job_id"], verdict["passed"]) == (report["audit_job_id"], False)
    assert (verdict["samples_checked"], verdict["samples_failed"]) == (job["samples_total"], 1)

    train = [sys.executable, "-m", "eagle3", "train", "--job", job["job_id"], "--max-steps", "1", "--device", "cpu"]
    refused = subprocess.run([*train, "--require-audit"], env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and f"failed on 1 of {job['samples_total']} samples" in refused.stderr
    warned = subprocess.run(train, env=env, capture_output=True, text=True, timeout=600)
    assert warned.returncode == 0, warned.stderr[-2000:]
    assert "training anyway" in warned.stderr
