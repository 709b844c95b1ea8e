"""`eagle3 up` then `eagle3 submit` in another shell, as a user runs them: the stack makes a token for its session
and the CLI finds it, so a closed API changes nothing for the user; anyone else gets a 401."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.datasets import write_dataset
from tests.fixtures.processes import default_sigint, free_port, wait_until

pytestmark = pytest.mark.slow


def test_eagle3_up_hands_its_session_token_to_the_cli(tmp_path: Path, tiny_model_dir: Path, redis_url: str) -> None:
    home = tmp_path / "home"
    api_port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("EAGLE3_", "AWS_"))},
        "EAGLE3_HOME": str(home),
        "EAGLE3_REDIS_URL": redis_url,
        "EAGLE3_MODEL_PATH": str(tiny_model_dir),
        "EAGLE3_API_PORT": str(api_port),
        "EAGLE3_API_URL": f"http://127.0.0.1:{api_port}",
        "EAGLE3_INFERENCE_PORT": str(free_port()),
        "PYTHONUNBUFFERED": "1",
    }
    token_file = home / "api-token"
    with (tmp_path / "up.log").open("w") as log:
        up = subprocess.Popen(
            [sys.executable, "-m", "eagle3", "up", "--workers", "1"],
            env=env,
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=default_sigint,
        )
    try:
        # `eagle3 up`'s own line, printed once the token is written; the stack's log line before it ("local stack up")
        # comes just before the write, and a test reading the file then could run before it (CI, 2026-12-07).
        wait_until(lambda: "stack up: producer" in (tmp_path / "up.log").read_text(), timeout_s=300)
        assert oct(token_file.stat().st_mode & 0o777) == "0o600"
        anonymous = httpx.post(f"http://127.0.0.1:{api_port}/v1/jobs", json={"dataset_url": "x"}, timeout=30)
        assert anonymous.status_code == 401

        dataset, _ = write_dataset(home / "data" / "chats.jsonl", with_bad_lines=False)  # the stack's data folder
        submit = subprocess.run(
            [sys.executable, "-m", "eagle3", "submit", str(dataset), "--watch", "--job-id", "up-1"],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert submit.returncode == 0, submit.stdout[-2000:] + submit.stderr[-2000:]
        assert "submitted up-1" in submit.stdout and "job up-1: completed" in submit.stdout

        outside, _ = write_dataset(tmp_path / "elsewhere.jsonl", with_bad_lines=False)
        refused = subprocess.run(
            [sys.executable, "-m", "eagle3", "submit", str(outside)],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert refused.returncode != 0 and "is outside the dataset roots" in refused.stderr
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=120)
    assert not token_file.exists(), "the session token outlived its stack"
