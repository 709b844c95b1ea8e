"""Progress accounting against a real Redis: exactly-once counts, rate, ETA, states, rebuild from storage."""

import logging
import subprocess
import threading
from pathlib import Path

import pytest
import redis

from shared.lifecycle import progress
from shared.lifecycle.kinds import EXTRACT
from shared.lifecycle.kinds.extract import Extract
from shared.lifecycle.schemas import (
    DeadLetter,
    JobRecord,
    JobSpec,
    Manifest,
    ManifestSample,
    ModelRecord,
    SampleInput,
    ShardInput,
)
from shared.settings import Settings
from shared.storage import layout
from shared.storage.objects import open_storage
from tests.fixtures.processes import free_port, wait_until


def make_job(shards: int = 3, tokens_per_shard: int = 100) -> JobRecord:
    return JobRecord(
        job_id="job-a",
        created_at="2026-01-01T00:00:00",
        spec=JobSpec(dataset_url="/x.jsonl"),
        model=ModelRecord(
            path="/m",
            architecture="LlamaForCausalLM",
            num_hidden_layers=8,
            hidden_size=64,
            vocab_size=512,
            template_hash="h",
        ),
        aux_layer_ids=[1, 3, 4],
        hidden_size=64,
        bytes_per_token=528,
        samples_total=2 * shards,
        samples_rejected=1,
        samples_truncated=0,
        tokens_total=shards * tokens_per_shard,
        loss_tokens_total=10,
        shards_total=shards,
        projected_bytes=shards * tokens_per_shard * 528,
        draft_vocab_size=100,
        vocab_coverage=1.0,
        versions={},
    )


def make_manifest(shard_index: int, tokens: int = 100, nbytes: int = 50_000) -> Manifest:
    samples = [
        ManifestSample(
            sample_index=2 * shard_index + i,
            sample_id=f"s{i}",
            key=f"k{i}",
            num_tokens=tokens // 2,
            loss_tokens=1,
            bytes=nbytes // 2,
            sha256="0" * 64,
        )
        for i in range(2)
    ]
    return Manifest.of(make_job(), shard_index, samples, worker="w", started_at="t", committed_at="t")


class CountedManifest(Manifest):
    """The manifest of a kind with counters of its own."""

    counters: dict[str, int]


WIDGET_COUNTERS = {"widgets_done": "Widgets made"}


class Counting(Extract):
    """A kind beside regenerate with counters of its own, whose dead shard takes only its loss tokens."""

    name = "counting"
    counters = WIDGET_COUNTERS

    def shard_size(self, shard: ShardInput) -> tuple[int, int]:
        return len(shard.samples), sum(sum(s.loss_mask) for s in shard.samples)


def test_commit_counts_once_and_job_completes(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    progress.register_job(client, make_job(), "file:///tmp/x", EXTRACT)
    assert progress.job_progress(client, "job-a").state == "queued"
    assert progress.record_commit(client, make_manifest(0))
    assert not progress.record_commit(client, make_manifest(0))  # redelivered: not counted again
    p = progress.job_progress(client, "job-a", budget_bytes=10**6)
    assert (p.state, p.shards_committed, p.samples_done, p.tokens_done, p.bytes_stored) == (
        "running",
        1,
        2,
        100,
        50_000,
    )
    assert p.bytes_per_token == 500 and p.projected_total_bytes == 150_000
    assert p.budget_headroom_bytes == 10**6 - 150_000
    assert p.tokens_per_second > 0 and p.eta_seconds is not None
    progress.record_commit(client, make_manifest(1))
    progress.record_commit(client, make_manifest(2))
    p = progress.job_progress(client, "job-a")
    assert p.state == "completed" and p.tokens_done == p.tokens_total == 300 and p.eta_seconds == 0
    events = client.xrange(progress.events_key("job-a"))
    assert [e[1][b"shard_index"] for e in events] == [b"0", b"1", b"2"]


def test_dead_letter_then_commit_on_resume_moves_counts(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    progress.register_job(client, make_job(shards=1), "file:///tmp/x", EXTRACT)
    letter = DeadLetter(
        job_id="job-a", shard_index=0, error_type="InferenceUnavailable", reason="down", retries=3, worker="w"
    )
    assert progress.record_dead_letter(client, letter, num_samples=2, num_tokens=100)
    assert not progress.record_dead_letter(client, letter, num_samples=2, num_tokens=100)
    p = progress.job_progress(client, "job-a")
    assert (p.state, p.shards_dead_lettered, p.samples_failed, p.tokens_failed) == ("completed_with_errors", 1, 2, 100)
    progress.record_commit(client, make_manifest(0))
    p = progress.job_progress(client, "job-a")
    assert (p.state, p.shards_dead_lettered, p.samples_failed, p.shards_committed) == ("completed", 0, 0, 1)


def test_cancel_marks_job_cancelled(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    progress.register_job(client, make_job(), "file:///tmp/x", EXTRACT)
    progress.cancel(client, "job-a")
    assert progress.is_cancelled(client, "job-a")
    assert progress.job_progress(client, "job-a").state == "cancelled"


def test_rebuild_recounts_from_storage(redis_url: str, tmp_path) -> None:
    client = redis.Redis.from_url(redis_url)
    storage = open_storage(tmp_path.as_uri())
    job = make_job()
    progress.register_job(client, job, storage.url, EXTRACT)
    for k in range(2):
        storage.put(layout.manifest("job-a", k), make_manifest(k).model_dump_json().encode())
    shard = ShardInput(
        job_id="job-a",
        shard_index=2,
        samples=[SampleInput(sample_index=4, sample_id="s", line=1, input_ids=[1] * 60, loss_mask=[1] * 60)],
    )
    storage.put(layout.shard_input("job-a", 2), shard.model_dump_json().encode())
    letter = DeadLetter(job_id="job-a", shard_index=2, error_type="E", reason="r", retries=0, worker="w")
    storage.put(layout.dead_letter("job-a", 2), letter.model_dump_json().encode())
    client.flushdb()  # Redis lost everything
    progress.register_job(client, job, storage.url, EXTRACT)
    progress.rebuild(client, storage, job, EXTRACT)
    p = progress.job_progress(client, "job-a")
    assert (p.shards_committed, p.tokens_done, p.shards_dead_lettered, p.tokens_failed) == (2, 200, 1, 60)
    assert p.state == "completed_with_errors"


def test_a_rebuild_counts_the_counters_of_the_jobs_kind_once(redis_url: str, tmp_path: Path) -> None:
    """resume rebuilds a job that Redis still knows: a kind's own counters are reset before the manifests are counted
    again, like progress's."""
    client = redis.Redis.from_url(redis_url)
    storage = open_storage(tmp_path.as_uri())
    job = make_job()
    progress.register_job(client, job, storage.url, Counting())
    assert client.hget(progress.job_key("job-a"), "widgets_done") == b"0"
    for k in range(2):
        manifest = CountedManifest(**make_manifest(k).model_dump(), counters={"widgets_done": 3})
        storage.put(layout.manifest("job-a", k), manifest.model_dump_json().encode())
        assert progress.record_commit(client, manifest)
    progress.rebuild(client, storage, job, Counting())
    progress.rebuild(client, storage, job, Counting())
    assert client.hget(progress.job_key("job-a"), "widgets_done") == b"6"
    p = progress.job_progress(client, "job-a")
    assert (p.shards_committed, p.tokens_done, p.state) == (2, 200, "running")
    assert p.counters == {"widgets_done": 6}  # the kind's own, reported whichever kind it is


class Finishing(Extract):
    """A kind with a last step after its final shard."""

    name = "finishing"
    finalizes = True


def test_a_finalizing_kind_runs_until_its_last_step_is_recorded(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    progress.register_job(client, make_job(shards=2), "file:///tmp/x", Finishing())
    for k in range(2):
        progress.record_commit(client, make_manifest(k))
    assert progress.job_progress(client, "job-a").state == "running"  # every shard committed, the last step not run
    progress.mark_finalized(client, "job-a", chained_job_id=None, error=None)
    assert progress.job_progress(client, "job-a").state == "completed"
    # The same commits for a kind that does not finalize: complete with its last shard, and no counters of its own.
    client.delete(progress.job_key("job-a"), progress.committed_key("job-a"))
    progress.register_job(client, make_job(shards=2), "file:///tmp/x", EXTRACT)
    for k in range(2):
        progress.record_commit(client, make_manifest(k))
    p = progress.job_progress(client, "job-a")
    assert (p.state, p.counters) == ("completed", {})


def test_a_rebuild_sizes_a_dead_shard_as_its_kind_does_and_counts_one_without_input(
    redis_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    client = redis.Redis.from_url(redis_url)
    storage = open_storage(tmp_path.as_uri())
    job = make_job()
    progress.register_job(client, job, storage.url, Counting())
    storage.put(layout.manifest("job-a", 0), make_manifest(0).model_dump_json().encode())
    sample = SampleInput(sample_index=2, sample_id="s", line=3, input_ids=[1] * 60, loss_mask=[0] * 40 + [1] * 20)
    shard = ShardInput(job_id="job-a", shard_index=1, samples=[sample])
    storage.put(layout.shard_input("job-a", 1), shard.model_dump_json().encode())
    for k in (1, 2):  # shard 2's input is gone
        letter = DeadLetter(job_id="job-a", shard_index=k, error_type="E", reason="r", retries=0, worker="w")
        storage.put(layout.dead_letter("job-a", k), letter.model_dump_json().encode())
    with caplog.at_level(logging.ERROR, logger="shared.lifecycle.kind"):
        progress.rebuild(client, storage, job, Counting())
    p = progress.job_progress(client, "job-a")
    assert (p.shards_committed, p.shards_dead_lettered, p.samples_failed, p.tokens_failed) == (1, 2, 1, 20)
    assert p.state == "completed_with_errors"
    assert f"job=job-a shard=2 has no input in {storage.url}" in caplog.text


def test_a_paused_job_says_why_until_a_shard_commits(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    progress.register_job(client, make_job(), "file:///tmp/x", EXTRACT)
    reason = "storage full: s3 put b/k: storage full (InsufficientStorage: no room)"
    progress.record_pause(client, "job-a", reason)
    p = progress.job_progress(client, "job-a")
    assert (p.state, p.paused_reason) == ("paused", reason)
    assert not p.finished
    progress.record_commit(client, make_manifest(0))  # storage took a manifest: there is room again
    p = progress.job_progress(client, "job-a")
    assert (p.state, p.paused_reason) == ("running", None)
    progress.record_pause(client, "job-gone", "storage full")  # a job Redis does not know is not half-created
    assert not client.exists(progress.job_key("job-gone"))


def test_a_progress_client_rides_out_a_redis_restart(tmp_path: Path) -> None:
    """The workers' and trainer's client (progress.connect): a count made while Redis restarts waits for it and
    lands once, at the production default wait."""
    port = free_port()
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--appendonly", "yes", "--dir", str(tmp_path)]

    servers: list[subprocess.Popen] = []  # every redis-server started here, stopped at the end whatever happens

    def start() -> None:
        servers.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL))
        wait_until(lambda: redis.Redis(port=port).ping(), timeout_s=10)

    start()
    try:
        client = progress.connect(
            f"redis://127.0.0.1:{port}/0", outage_wait_s=Settings(_env_file=None).redis_outage_wait_s
        )
        job = make_job()
        progress.register_job(client, job, "file:///s", EXTRACT)
        servers[0].terminate()  # SIGTERM, as a container restart: Redis saves its append-only file and exits
        servers[0].wait(timeout=10)
        later = threading.Timer(3.0, start)
        later.start()
        assert progress.record_commit(client, make_manifest(0))  # waits for the restarted Redis
        later.join()
        assert len(servers) == 2
        assert not progress.record_commit(client, make_manifest(0))  # counted once
        assert progress.job_progress(client, "job-a").shards_committed == 1
    finally:
        for server in servers:
            server.terminate()
            server.wait(timeout=10)
