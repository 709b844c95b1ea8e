"""Queue and task names shared by the producer (which sends) and the worker (which consumes)."""

EXTRACT_QUEUE = "eagle3.extract"
EXTRACT_TASK = "eagle3.extract_shard"
# Regeneration shards travel on the same queue, so every worker (and KEDA's one trigger) sees them.
REGENERATE_TASK = "eagle3.regenerate_shard"


def extract_task_id(job_id: str, shard_index: int) -> str:
    # Deterministic, so a task is recognisable in Flower and in logs across redeliveries.
    return f"{job_id}:shard:{shard_index:06d}"


def regenerate_task_id(job_id: str, shard_index: int) -> str:
    return f"{job_id}:regenerate:{shard_index:06d}"
