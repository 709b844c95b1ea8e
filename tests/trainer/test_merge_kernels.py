"""The TTT attention's Triton merges, the trainer's default on CUDA, equal the merges as written: run on the CPU in
Triton's interpreter (tests/trainer/merge_kernels_check.py, in a process of its own with the Triton that `make
install` puts in .venv/triton-cpu); on a GPU, test_drafter.py's CUDA test runs them compiled."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
TRITON_CPU = REPO / ".venv" / "triton-cpu"


def test_triton_merges_equal_the_merges_as_written_in_the_interpreter() -> None:
    if not (TRITON_CPU / "triton").is_dir():
        pytest.fail(f"no Triton in {TRITON_CPU}: `make install` puts it there")
    env = {**os.environ, "PYTHONPATH": str(TRITON_CPU), "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "tests.trainer.merge_kernels_check"]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "merge kernels agree" in result.stdout
