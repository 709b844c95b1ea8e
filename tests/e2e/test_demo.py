"""`eagle3 demo` as a user runs it: a real stack of processes, a report, twice in a row, and Ctrl-C."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from eagle3.demo import MIN_TRAIN_SECONDS
from tests.fixtures.processes import default_sigint, wait_until

pytestmark = pytest.mark.slow

TRAINER_FIELDS = {
    "train_steps", "train_tokens", "train_seconds", "acc_per_position", "simulated_acceptance_length",
    "measured_acceptance_length", "untrained_measured_acceptance_length", "export_dir",
}  # fmt: skip
REPORT_FIELDS = {
    "job_id",
    "storage_root",
    "samples_total",
    "samples_committed",
    "samples_rejected",
    "tokens_committed",
    "shards_committed",
    "bytes_stored",
    "wall_seconds",
    "tokens_per_second",
    "aux_layer_ids",
    "hidden_size",
    "model",
}


def demo_env(home: Path, redis_url: str) -> dict[str, str]:
    return {
        **os.environ,
        "EAGLE3_HOME": str(home),
        "EAGLE3_REDIS_URL": redis_url,
        "EAGLE3_STORAGE_URL": (home / "storage").as_uri(),
        "EAGLE3_DEMO_REGENERATE": "0",  # the original conversations: regeneration has its own test below
        "PYTHONUNBUFFERED": "1",
    }


def demo_argv(model: Path, *, train_seconds: float | None = 0) -> list[str]:
    """train_seconds None: the default, training for what is left of the time budget (1 s here, so the minimum)."""
    training = ["--time-budget", "1"] if train_seconds is None else ["--train-seconds", str(train_seconds)]
    return [
        sys.executable,
        "-m",
        "eagle3",
        "demo",
        "--model",
        str(model),
        "--conversations",
        "24",
        "--shard-token-budget",
        "600",
        *training,
        "--eval-prompts",
        "2",
        "--eval-max-new-tokens",
        "12",
    ]


def processes_with_home(home: Path) -> list[int]:
    """Every process that inherited this demo's EAGLE3_HOME: the demo's own children."""
    needle = f"EAGLE3_HOME={home}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def test_demo_writes_a_report_and_runs_twice(tmp_path: Path, tiny_model_dir: Path, redis_url: str) -> None:
    env = demo_env(tmp_path, redis_url)
    reports = []
    for train_seconds in (None, 0):  # the second run skips training, to keep the suite short
        argv = demo_argv(tiny_model_dir, train_seconds=train_seconds)
        result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        reports.append(json.loads((tmp_path / "demo" / "report.json").read_text()))
    first, second = reports
    assert set(first) >= REPORT_FIELDS
    assert first["job_id"] != second["job_id"]
    assert first["samples_committed"] == first["samples_total"] - first["samples_rejected"] > 0
    assert first["tokens_committed"] == second["tokens_committed"] > 0
    assert first["shards_committed"] > 1 and first["bytes_stored"] > 0 and first["tokens_per_second"] > 0
    assert first["aux_layer_ids"] == [1, 3, 4] and first["hidden_size"] == 64
    assert first["model"] == str(tiny_model_dir)
    job_dir = Path(first["storage_root"].removeprefix("file://"))
    assert len(list((job_dir / "manifests").iterdir())) == first["shards_committed"]
    assert processes_with_home(tmp_path) == []
    assert set(first) >= TRAINER_FIELDS and not TRAINER_FIELDS & set(second)
    assert first["train_tokens"] > 0 and first["train_steps"] > 0
    # The budget was spent before training started, so training got the demo's minimum, and the wall time covers it.
    assert first["train_seconds"] >= 0.9 * MIN_TRAIN_SECONDS
    assert first["demo_wall_seconds"] > first["train_seconds"] and second["demo_wall_seconds"] > 0
    assert len(first["acc_per_position"]) == 7 and all(0 <= a <= 1 for a in first["acc_per_position"])
    assert first["measured_acceptance_length"] >= 1 and first["untrained_measured_acceptance_length"] >= 1
    assert first["matches_greedy"]
    export_dir = Path(first["export_dir"])
    assert (export_dir / "config.json").is_file() and (export_dir / "model.safetensors").is_file()


def test_ctrl_c_stops_every_process_the_demo_started(tmp_path: Path, tiny_model_dir: Path, redis_url: str) -> None:
    log = (tmp_path / "demo.log").open("w")
    demo = subprocess.Popen(
        demo_argv(tiny_model_dir),
        env=demo_env(tmp_path, redis_url),
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=default_sigint,
    )
    try:
        # Wait until the whole stack runs: inference server, two workers and the producer.
        wait_until(lambda: "3/4" in (tmp_path / "demo.log").read_text(), timeout_s=180)
        assert len(processes_with_home(tmp_path)) >= 4
        demo.send_signal(signal.SIGINT)
        assert demo.wait(timeout=120) == 130
    finally:
        if demo.poll() is None:
            demo.kill()
    deadline = time.monotonic() + 10
    while processes_with_home(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_with_home(tmp_path) == []
    assert "every process of the stack was stopped" in (tmp_path / "demo.log").read_text()


def test_demo_regenerates_the_conversations_first_by_default_with_its_own_redis(
    tmp_path: Path, tiny_model_dir: Path, redis_url: str
) -> None:
    # As a user runs it: no EAGLE3_DEMO_REGENERATE, and no EAGLE3_REDIS_URL although a Redis (the fixture's) runs.
    env = {
        k: v
        for k, v in demo_env(tmp_path, redis_url).items()
        if k not in ("EAGLE3_DEMO_REGENERATE", "EAGLE3_REDIS_URL")
    }
    argv = [*demo_argv(tiny_model_dir), "--regenerate-max-new-tokens", "8", "--regenerate-shard-size", "6"]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "3/5" in result.stdout and "regenerating the assistant turns" in result.stdout
    report = json.loads((tmp_path / "demo" / "report.json").read_text())
    regenerated = report["regeneration"]
    assert report["job_id"] == regenerated["chained_job_id"] == f"{regenerated['job_id']}-extract"
    assert regenerated["conversations_written"] + regenerated["conversations_failed"] == 24
    assert report["samples_committed"] == report["samples_total"] == regenerated["conversations_written"] > 0
    assert regenerated["generated_tokens"] > 0 and regenerated["turns"] >= regenerated["conversations_written"]
    assert "redis" in {path.name for path in (tmp_path / "demo" / "logs").iterdir()}  # it started its own
    assert redis.Redis.from_url(redis_url).keys(f"*{regenerated['job_id']}*") == []  # and left the other alone
    assert processes_with_home(tmp_path) == []
