"""`eagle3 doctor` against the real stack: every check passes on a healthy one (one sample captured, committed to a
scratch job, loaded by the trainer and trained one step, then removed); each breakage is reported with its reason."""

import subprocess
import sys

import pytest

from eagle3.doctor import train_one_step
from shared.lifecycle import progress
from shared.ops import doctor
from shared.storage.objects import open_storage
from tests.fixtures.processes import free_port
from tests.ops.conftest import OpsStack

pytestmark = pytest.mark.slow


def _by_name(checks: list[doctor.Check]) -> dict[str, doctor.Check]:
    return {c.name: c for c in checks}


def _settings(ops_stack: OpsStack, **changes: object):
    return ops_stack.settings.model_copy(
        update={"inference_url": ops_stack.stack.env["EAGLE3_INFERENCE_URL"], **changes}
    )


def test_healthy_stack_passes_every_check_and_leaves_no_scratch_job(ops_stack: OpsStack) -> None:
    settings = _settings(ops_stack, storage_budget_bytes=10**9)
    storage = open_storage(settings.storage_url, settings)
    before = set(storage.list(""))

    checks = doctor.run_checks(
        settings, model_path=ops_stack.model_dir, dataset_url=str(ops_stack.dataset), train_probe=train_one_step
    )

    failed = {c.name: c.detail for c in checks if c.status != "pass"}
    assert not failed, failed
    names = [c.name for c in checks]
    assert names[:2] == ["redis", "storage"] and names[-1] == "e2e: trainer loads, one step"
    assert "1 step" in _by_name(checks)["e2e: trainer loads, one step"].detail
    after = set(storage.list(""))
    assert after == before, f"left behind: {sorted(after - before)}, removed: {sorted(before - after)}"
    assert not [j for j in progress.list_jobs(ops_stack.redis) if j.startswith("doctor-")]


def test_redis_down_fails_with_the_reason_and_skips_end_to_end(ops_stack: OpsStack) -> None:
    settings = _settings(ops_stack, redis_url=f"redis://127.0.0.1:{free_port()}/0")
    checks = _by_name(doctor.run_checks(settings, model_path=ops_stack.model_dir, train_probe=train_one_step))
    assert checks["redis"].status == "fail" and "ConnectionError" in checks["redis"].detail
    assert checks["storage"].status == "pass"
    assert checks["end to end"].status == "fail" and "redis" in checks["end to end"].detail


def test_wrong_layer_ids_fail_with_the_valid_range(ops_stack: OpsStack) -> None:
    checks = _by_name(
        doctor.run_checks(
            _settings(ops_stack), model_path=ops_stack.model_dir, aux_layer_ids=[1, 3, 9], end_to_end=False
        )
    )
    assert checks["layer ids"].status == "fail"
    assert "[9] outside the target's decoder layers [0, 8)" in checks["layer ids"].detail


def test_a_server_serving_another_model_fails_the_inference_check(ops_stack: OpsStack) -> None:
    checks = _by_name(doctor.run_checks(_settings(ops_stack), model_path=ops_stack.other_model_dir, end_to_end=False))
    inference = next(c for name, c in checks.items() if name.startswith("inference "))
    assert inference.status == "fail" and "hidden_size 64 (target 32)" in inference.detail


def test_budget_smaller_than_the_projection_fails(ops_stack: OpsStack) -> None:
    checks = _by_name(
        doctor.run_checks(
            _settings(ops_stack, storage_budget_bytes=1000),
            model_path=ops_stack.model_dir,
            dataset_url=str(ops_stack.dataset),
            end_to_end=False,
        )
    )
    assert checks["storage budget"].status == "fail" and "headroom -" in checks["storage budget"].detail


def test_cli_prints_the_table_and_exits_non_zero_on_failure(ops_stack: OpsStack) -> None:
    env = {**ops_stack.stack.env, "EAGLE3_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0", "COLUMNS": "200"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "eagle3",
            "doctor",
            "--model",
            str(ops_stack.model_dir),
            "--aux-layer-ids",
            "1,3,9",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAIL" in result.stdout and "PASS" in result.stdout
    assert "doctor: 4 check(s) failed: redis, layer ids, workers, end to end" in result.stderr
