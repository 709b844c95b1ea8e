"""The bf16-against-fp8 benchmark end to end on the tiny model: both extractions, both trainings, both evaluations."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_storage_dtype_bench_extracts_trains_and_evaluates_both(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "storage_dtype.json"
    command = [sys.executable, "-m", "bench.storage_dtype", "--model", str(tiny_model_dir), "--conversations", "8",
               "--held-out", "8", "--steps", "2", "--batch-tokens", "256", "--draft-vocab-size", "64",
               "--max-prompts", "1", "--max-new-tokens", "4", "--json-out", str(out)]  # fmt: skip
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    results = json.loads(out.read_text())
    bf16, fp8 = results["bfloat16"], results["fp8_e4m3"]
    # Hidden 64: the per-token scales weigh more than at a real model's width, so fp8 is well above half here.
    assert 0.5 < fp8["bytes_per_token"] / bf16["bytes_per_token"] < 0.7
    for result in (bf16, fp8):
        trained = [r for r in result["acceptance"] if r["drafter"] == "trained"]
        assert [Path(r["file"]).name for r in trained] == ["heldout-chatterbot.jsonl", "heldout-chitchat.jsonl"]
        assert all(r["acceptance_length"] >= 1.0 for r in trained)
    assert any(r["drafter"] == "untrained" for r in bf16["acceptance"])
