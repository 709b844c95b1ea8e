"""The SGLang capture benchmark: its steady-rate arithmetic, and the whole command against a running capture server
(the reference server on the tiny model speaks the same protocol; on a GPU host it runs against SGLang)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.sglang_capture import steady_rates

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_steady_rate_cancels_what_a_run_pays_once() -> None:
    # 1,000 tokens/s plus 0.5 s paid once per run; the stock server pays nothing once.
    results = {
        "stock @8, 10 prompts": {"tokens": 10_000, "seconds": [10.0, 10.2, 9.9]},
        "stock @8, 40 prompts": {"tokens": 40_000, "seconds": [40.1, 40.0, 39.8]},
        "end to end @8, 10 prompts": {"tokens": 10_000, "seconds": [10.5, 10.6, 10.4]},
        "end to end @8, 40 prompts": {"tokens": 40_000, "seconds": [40.5, 40.4, 40.6]},
        "reference @8, 40 prompts": {"tokens": 40_000, "seconds": [50.0]},  # one length only: no steady row
    }
    steady = steady_rates(results, [10, 40])
    assert set(steady) == {"stock @8, steady (40 - 10 prompts)", "end to end @8, steady (40 - 10 prompts)"}
    stock, end_to_end = steady["stock @8, steady (40 - 10 prompts)"], steady["end to end @8, steady (40 - 10 prompts)"]
    assert stock["tokens_s"] == pytest.approx(30_000 / 30.0)
    assert stock["fixed_s"] == pytest.approx(0.0, abs=1e-3)
    assert end_to_end["tokens_s"] == pytest.approx(30_000 / 30.0)
    assert end_to_end["fixed_s"] == pytest.approx(0.5, abs=1e-3)


def test_the_benchmark_measures_every_row_at_two_lengths(
    tiny_model_dir: Path, reference_server_url: str, reference_shm_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "capture.json"
    left_before = set(reference_shm_dir.iterdir())  # the server is shared with other tests
    command = [sys.executable, "-m", "bench.sglang_capture", "--url", reference_server_url,
               "--baseline-url", reference_server_url, "--shm-dir", str(reference_shm_dir),
               "--model", str(tiny_model_dir), "--prompts", "4,12", "--prompt-tokens", "32", "--concurrency", "2",
               "--worker-processes", "2", "--repeats", "1", "--transports", "shm,body",
               "--work", str(tmp_path / "work"), "--json", str(out)]  # fmt: skip
    env = {**os.environ, "COLUMNS": "200"}  # the table's rows unwrapped
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    results = json.loads(out.read_text())["results"]
    measures = [
        "SGLang prefill, capture off (stock server) @2",
        "plain requests on the capture server @2",
        "capture driven directly, shm @2",
        "end to end, shm, 2 worker processes @2",
        "capture driven directly, body @2",
        "end to end, body, 2 worker processes @2",
    ]
    runs = {f"{m}, {n} prompts": n for n in (4, 12) for m in measures}
    assert set(results) == set(runs) | {f"{m}, steady (12 - 4 prompts)" for m in measures}
    for label, prompts in runs.items():
        assert results[label]["tokens"] == prompts * 32
        assert results[label]["tokens_s"] > 0
    assert "steady (12 - 4 prompts)" in result.stdout  # the table
    assert set(reference_shm_dir.iterdir()) <= left_before, "every capture file was read and removed"
