"""The trainer's Triton kernels, its default on CUDA (the TTT attention's merges, the soft cross-entropy), equal the
functions they stand for as written: run on the CPU in Triton's interpreter (tests/trainer/kernels_check.py, in a
process of its own with the Triton that `make install` puts in .venv/triton-cpu); on a GPU, the CUDA tests of
test_drafter.py and test_loss.py run them compiled."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
TRITON_CPU = REPO / ".venv" / "triton-cpu"


def test_triton_kernels_equal_the_functions_as_written_in_the_interpreter() -> None:
    if not (TRITON_CPU / "triton").is_dir():
        pytest.fail(f"no Triton in {TRITON_CPU}: `make install` puts it there")
    env = {**os.environ, "PYTHONPATH": str(TRITON_CPU), "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "tests.trainer.kernels_check"]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kernels agree" in result.stdout
