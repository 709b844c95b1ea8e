"""`shard_seconds` on the real stack: the workers' committed extraction shards leave their rate in Redis, and a job
submitted through the API is planned with shards of that many seconds of it."""

import pytest

from shared.lifecycle import shard_metrics
from tests.ops.conftest import OpsStack, RanJobs

pytestmark = pytest.mark.slow


def test_a_job_in_seconds_gets_shards_of_the_workers_measured_rate(ops_stack: OpsStack, ran_jobs: RanJobs) -> None:
    rate = shard_metrics.recent_rate(ops_stack.redis, "extract")
    assert rate is not None and rate > 0  # the workers recorded the shards they committed
    seconds = 5000 / rate  # about 5,000 tokens a shard, inside the bounds

    job_id = ops_stack.submit(ops_stack.dataset, shard_seconds=seconds, draft_vocab_size=64)

    spec = ops_stack.api.get(f"/v1/jobs/{job_id}").json()["job"]["spec"]
    assert spec["shard_seconds"] == pytest.approx(seconds)
    assert spec["shard_token_budget"] == pytest.approx(5000, abs=1)
    assert ops_stack.wait_finished(job_id)["state"] == "completed"
