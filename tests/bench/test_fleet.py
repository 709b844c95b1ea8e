"""The fleet benchmark at a tiny N for a few seconds, as a subprocess (it starts and stops its own Redis, SeaweedFS,
stand-in, producer and workers): its table's numbers agree with each other and every submitted sample was committed
exactly once. Never its timings."""

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SAMPLE_TOKENS, SHARD_TOKENS = 128, 512  # four samples a shard
SAMPLES = 24  # six shards


@pytest.mark.slow
def test_fleet_bench_commits_every_sample_exactly_once(tmp_path: Path) -> None:
    out = tmp_path / "fleet.json"
    command = [sys.executable, "-m", "bench.fleet", "--workers", "2", "--processes", "1",
               "--sample-tokens", str(SAMPLE_TOKENS), "--shard-tokens", str(SHARD_TOKENS),
               "--min-samples", str(SAMPLES), "--shards-per-worker", "1", "--idle-seconds", "1",
               "--timeout", "240", "--work", str(tmp_path / "work"), "--json", str(out)]  # fmt: skip
    before = {p.pid for p in psutil.process_iter()}
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=420)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "fleet: one producer" in result.stdout  # the table was printed

    report = json.loads(out.read_text())
    [row] = report["rows"]
    [run] = report["runs"]["2"]
    assert row["workers"] == 2 and row["layout"] == "1x2"
    assert run["samples_submitted"] == run["samples_committed"] == SAMPLES
    assert run["duplicates"] == 0 and run["missing"] == 0 and run["exactly_once"]
    assert run["shards"] == SAMPLES * SAMPLE_TOKENS // SHARD_TOKENS
    assert run["shards_rerun"] == 0
    # The rates come from one window: its samples are four per shard, as planned.
    assert run["samples_per_s"] == pytest.approx(run["shards_per_s"] * SHARD_TOKENS / SAMPLE_TOKENS, rel=1e-6)
    assert run["redis_ops_per_s"] > 0 and run["redis_commands_per_shard"] > 0
    assert run["shard_s_p50"] <= run["shard_s_p99"] and run["commit_ms_p50"] <= run["commit_ms_p99"]
    assert run["reaper"]["redis_round_trips_per_sweep"] > 0
    assert run["load_before"] and run["load_after"]
    # Everything it started has stopped.
    left = [p for p in psutil.process_iter(["cmdline"]) if p.pid not in before and "bench.capture_standin" in
            " ".join(p.info["cmdline"] or [])]  # fmt: skip
    assert not left
