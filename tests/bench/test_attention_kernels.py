"""bench/attention_kernels on the CPU: every kernel timed at each length, and compared with the first."""

import json
import subprocess
import sys
from pathlib import Path

from services.trainer.drafter import CAUSAL_BLOCK_KERNELS


def test_each_kernel_is_timed_and_compared_at_each_length(tmp_path: Path) -> None:
    out = tmp_path / "attention_kernels.json"
    argv = [sys.executable, "-m", "bench.attention_kernels", "--lengths", "64", "96", "--repeats", "2"]
    result = subprocess.run([*argv, "--device", "cpu", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["length"] for row in rows] == [64, 96]
    first, *others = CAUSAL_BLOCK_KERNELS
    for row in rows:
        assert sorted(row["kernels"]) == sorted(CAUSAL_BLOCK_KERNELS)
        assert all(len(k["runs_ms"]) == 2 and k["forward_backward_ms"] > 0 for k in row["kernels"].values())
        assert all(k["ran"] == "cpu" for k in row["kernels"].values())  # the switch is for CUDA
        for kernel in others:
            # on the CPU every kernel is the CPU's flash kernel: the same numbers
            assert row["kernels"][kernel][f"relative_difference_from_{first}"] == 0.0
    assert "TTT attention" in result.stdout
