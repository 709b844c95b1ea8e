"""bench/stack_extract's timeline of a job from its manifests: a worker's time with no shard open, also where its pool
processes ran shards side by side."""

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from bench.stack_extract import describe_timeline, shard_timeline
from shared.lifecycle.schemas import Manifest
from shared.storage import layout
from shared.storage.objects import FileStorage

CREATED = datetime(2026, 12, 7, 0, 0, 0, tzinfo=UTC)


def at(seconds: float) -> str:
    return (CREATED + timedelta(seconds=seconds)).isoformat(timespec="milliseconds")


def manifest(shard_index: int, worker: str, started: float, committed: float, capture: float) -> Manifest:
    return Manifest(
        job_id="job-t", shard_index=shard_index, aux_layer_ids=[1, 2, 3], hidden_size=8, dtype="bfloat16", samples=[],
        num_samples=0, num_tokens=0, loss_tokens=0, bytes=0, worker=worker, started_at=at(started),
        committed_at=at(committed), timings_s={"capture_and_write": capture},
    )  # fmt: skip


def test_a_workers_idle_time_is_its_span_less_the_union_of_its_shards(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path.as_uri(), fsync=False)
    storage.put(layout.job_json("job-t"), json.dumps({"created_at": at(0)}).encode())
    shards = [
        manifest(0, "host:1", 0.5, 4.0, 3.0),  # host:1 runs two shards side by side, then a third after a gap
        manifest(1, "host:1", 1.0, 3.0, 1.5),
        manifest(2, "host:1", 5.0, 6.0, 0.75),
        manifest(3, "host:2", 0.25, 8.0, 7.0),
    ]
    for m in shards:
        storage.put(layout.manifest("job-t", m.shard_index), m.model_dump_json().encode())

    timeline = shard_timeline(storage, "job-t")

    assert timeline["first_shard_start_s"] == pytest.approx(0.25)
    assert timeline["last_commit_s"] == pytest.approx(8.0)
    one, two = timeline["workers"]["host:1"], timeline["workers"]["host:2"]
    # host:1 had a shard open over [0.5, 4] and [5, 6]: 1 s without one between them, 2 s at the end.
    assert one["between_shards_s"] == pytest.approx(1.0) and one["after_last_shard_s"] == pytest.approx(2.0)
    assert two["between_shards_s"] == pytest.approx(0.0) and two["after_last_shard_s"] == pytest.approx(0.0)
    assert [s["capture_and_write_s"] for s in timeline["shards"]] == [3.0, 1.5, 0.75, 7.0]  # by worker, then start
    assert "1.00 s at most, idle at the end 2.00 s at most" in describe_timeline(timeline).replace("\n", " ")
