"""The trainer data loader benchmark at tiny sizes, on local storage and on SeaweedFS that it starts itself: the
report's structure, and that every pass read (raw) or loaded and verified (loader, loop) every sample. Never its
timings."""

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SAMPLES, SHARD_SAMPLES = 6, 4  # two shards, the second one short
BATCHES = 3  # two 32-token samples fill a 64-token batch
REPEATS = 2
STEP_MS = [0.0, 5.0]
PYTHON_STEP_MS = 5.0
READ_PROCESSES = [0, 2]  # the loader's threads reading, then two reading processes
THROUGHPUT_FIELDS = {"gb_s", "ratio_to_raw", "seconds", "ms_per_batch", "repeats"}
WAIT_FIELDS = {
    "ms_per_step",
    "first_wait_ms",
    "later_wait_median_ms",
    "later_wait_max_ms",
    "later_waited_fraction",
    "step_in_loop_ms",
    "step_alone_ms",
}


def run_bench(storage: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path / "loader.json"
    command = [sys.executable, "-m", "bench.loader", "--hidden", "64", "--tokens-per-sample", "32",
               "--samples", str(SAMPLES), "--shard-samples", str(SHARD_SAMPLES), "--batch-tokens", "64",
               "--io-threads", "2", "--read-processes", ",".join(map(str, READ_PROCESSES)), "--storage", storage,
               "--step-ms", ",".join(f"{ms:g}" for ms in STEP_MS),
               "--python-step-ms", f"{PYTHON_STEP_MS:g}", "--repeats", str(REPEATS), "--dir", str(tmp_path),
               "--json", str(out)]  # fmt: skip
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300), out


def check_summary(summary: dict[str, Any], fields: set[str]) -> None:
    """Its fields are there, and every repeat's pass took every sample (and the loader refused none)."""
    assert summary.keys() >= fields
    assert len(summary["repeats"]) == REPEATS
    for repeat in summary["repeats"]:
        assert repeat["samples"] == SAMPLES and repeat["skipped"] == 0, repeat


@pytest.mark.parametrize("storage", ["local", "s3"])
def test_loader_bench_reads_and_verifies_every_sample(storage: str, tmp_path: Path) -> None:
    result, out = run_bench(storage, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    report = json.loads(out.read_text())
    assert report["config"]["storage"] == storage and report["config"]["repeats"] == REPEATS
    job = report["job"]
    assert (job["samples"], job["shards"], job["batches"]) == (SAMPLES, 2, BATCHES) and job["bytes"] > 0
    check_summary(report["raw_read"], THROUGHPUT_FIELDS)
    assert [loader["read_processes"] for loader in report["loader"]] == READ_PROCESSES
    for loader in report["loader"]:
        check_summary(loader, THROUGHPUT_FIELDS)

    steps = [*(f"{ms:g} ms step" for ms in STEP_MS), f"{PYTHON_STEP_MS:g} ms Python step"]
    assert [(loop["step"], loop["read_processes"]) for loop in report["training_loop"]] == [
        (step, n) for step in steps for n in READ_PROCESSES
    ]
    for loop in report["training_loop"]:
        check_summary(loop, THROUGHPUT_FIELDS | WAIT_FIELDS)
        for repeat in loop["repeats"]:
            assert repeat["steps"] == BATCHES and len(repeat["waits_ms"]) == BATCHES, repeat
        assert 0.0 <= loop["later_waited_fraction"] <= 1.0
        assert loop["step_alone_ms"] > 0 and loop["step_in_loop_ms"] > 0
