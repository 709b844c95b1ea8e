"""The multi-GPU benchmark's trainer path, run on CPUs (gloo) so that the GPU host only has to run it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.processes import kill_if_running

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_trainer_scaling_run_matches_one_process_and_reports(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "bench.multi_gpu", "trainer", "--gpus", "2", "--shape", "small",
               "--device", "cpu", "--steps", "4", "--warmup", "1", "--seq-len", "64", "--batch-tokens", "128",
               "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")]  # fmt: skip
    # A session of its own: on a timeout the whole group goes, torchrun's worker processes with it (subprocess.run's
    # timeout kills only the direct child, and two ranks left waiting on each other outlived the suite once).
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=300)
    finally:
        kill_if_running(process, group=True)
    assert process.returncode == 0, stdout[-3000:] + stderr[-3000:]

    report = json.loads((tmp_path / "out" / "multi_gpu_trainer.json").read_text())
    assert report["gpus"] == 2 and len(report["losses_n_processes"]) == 4
    assert report["losses_n_processes"] == pytest.approx(report["losses_one_process"], rel=1e-4)
    assert report["max_relative_loss_difference"] < 1e-4
    assert report["one_process_tokens_per_second"] > 0 and report["n_process_tokens_per_second"] > 0
