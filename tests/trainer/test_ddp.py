"""DDP on CPU: two processes under torchrun (gloo) stay in sync and compute what one process computes at the
same global batch."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.trainer.config import TrainConfig
from services.trainer.train import train
from shared.settings import Settings
from shared.storage.objects import open_storage
from tests.trainer.shard_builders import ExtractedJob

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
STEPS = 6


def test_two_processes_stay_in_sync_and_match_one_process(extracted_job: ExtractedJob, tmp_path: Path) -> None:
    common = {"max_steps": STEPS, "batch_tokens": 256, "max_length": 128, "lr": 3e-3, "epochs": 5, "log_every": 1}
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in common.items()]
    env = {
        **os.environ,
        "EAGLE3_STORAGE_URL": extracted_job.storage_url,
        "EAGLE3_HOME": str(tmp_path / "home"),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO_ROOT),
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "eagle3",
    ]
    command += ["train", "--job", extracted_job.job_id, "--run-name", "ddp", "--device", "cpu", *flags]
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-6000:]
    summary = json.loads(result.stdout[result.stdout.index("{") :])  # rank 0 prints the summary
    assert summary["world_size"] == 2 and summary["steps"] == STEPS

    # In sync: both ranks hold the same weights, byte for byte.
    rank0, rank1 = summary["rank_parameter_sha256"]
    assert rank0 == rank1

    # Same as one process taking both micro-batches of each step (grad_accum 2 = 2 ranks x 1).
    storage = open_storage(extracted_job.storage_url)
    ddp = torch.load(io.BytesIO(storage.get(summary["checkpoint_key"])), weights_only=True)
    single = train(
        TrainConfig(job_id=extracted_job.job_id, run_name="single", device="cpu", grad_accum=2, **common),
        settings=Settings(storage_url=extracted_job.storage_url, home=tmp_path / "home"),
    )
    assert [h["loss"] for h in ddp["history"]] == pytest.approx([h["loss"] for h in single["history"]], rel=1e-4)
    assert [h["train_tokens"] for h in ddp["history"]] == [h["train_tokens"] for h in single["history"]]
    one = torch.load(io.BytesIO(storage.get(single["checkpoint_key"])), weights_only=True)
    for name, tensor in one["drafter"].items():
        torch.testing.assert_close(ddp["drafter"][name], tensor, rtol=1e-4, atol=1e-5, msg=name)
