"""bench/stack_extract on the CPU: the whole command (the local stack with the reference server standing in for
SGLang, an extraction job through the API, the server's own prefill of the same sequences) and what it reports."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO_ROOT = Path(__file__).resolve().parents[2]


def test_the_job_and_the_prefill_measure_the_same_tokens(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "stack_extract.json"
    command = [
        sys.executable, "-m", "bench.stack_extract", "--model", str(tiny_model_dir), "--prompts", "6",
        "--prompt-tokens", "48", "--workers", "1", "--inference-concurrency", "2", "--repeats", "2",
        "--work-dir", str(tmp_path / "work"), "--json", str(out),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())

    assert report["server"] == "reference" and report["prompts"] == 6 and len(report["repeats"]) == 2
    assert report["tokens"] == 6 * 48  # every prompt exactly --prompt-tokens long
    assert report["shard_tokens"] == 6 * 48 // 2  # two shards for the one worker
    for repeat in report["repeats"]:
        # Every record extracted, and the yardstick prefilled exactly the tokens the job committed.
        assert repeat["job"]["samples"] == 6 and repeat["job"]["shards"] == 2, repeat
        assert repeat["job"]["tokens"] == repeat["prefill"]["tokens"] == report["tokens"], repeat
        assert repeat["job"]["tokens_per_second"] > 0 and repeat["prefill"]["tokens_per_second"] > 0
        # The job's timeline from its manifests: both shards, by the one worker, one after the other, inside the job.
        timeline = repeat["job"]["timeline"]
        shards = timeline["shards"]
        assert (
            len(shards) == 2
            and len({s["worker"] for s in shards}) == 1
            and set(timeline["workers"]) == {shards[0]["worker"]}
        ), timeline
        assert 0 <= timeline["first_shard_start_s"] <= shards[0]["started_s"] < shards[0]["committed_s"], timeline
        assert shards[0]["committed_s"] <= shards[1]["started_s"] < shards[1]["committed_s"], timeline
        assert timeline["last_commit_s"] == shards[1]["committed_s"], timeline
        assert all(0 < s["capture_and_write_s"] <= s["committed_s"] - s["started_s"] + 0.01 for s in shards), shards
    assert report["ratio"] == pytest.approx(report["job_tokens_per_second"] / report["prefill_tokens_per_second"])
    assert "extraction job through the stack" in result.stdout
    assert "from the job's creation to its first shard" in result.stdout
    # Each job was deleted once measured: nothing of them is left in storage.
    storage = tmp_path / "work" / "storage"
    left = [path for repeat in report["repeats"] for path in storage.glob(f"{repeat['job']['job_id']}/**/*")]
    assert storage.is_dir() and not left, left
