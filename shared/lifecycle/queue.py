"""The shard queue: its name, the task names and ids, and the send-only client the producer enqueues with."""

import time

from celery import Celery

# Every kind's shards travel on one queue, so that every worker takes either and KEDA scales on one list.
SHARD_QUEUE = "eagle3.extract"
# When a shard message was sent: the queue's oldest-message age (shared/ops/cluster.py).
SENT_TS_HEADER = "eagle3_sent_ts"


def task_name(kind: str) -> str:
    """The Celery task that runs one shard of a job kind."""
    return f"eagle3.{kind}_shard"


def task_id(kind: str, job_id: str, shard_index: int) -> str:
    # Deterministic, so a task is recognisable in Flower and in logs across redeliveries.
    return f"{job_id}:{kind}:{shard_index:06d}"


class ShardSender:
    """Sends shard tasks by name over the broker. It registers no task and reads no worker setting, so a process that
    only enqueues (the producer) never imports the worker's code."""

    def __init__(self, broker_url: str) -> None:
        self._app = Celery("eagle3-sender", broker=broker_url, set_as_current=False)
        self._app.conf.update(task_send_sent_event=True, broker_connection_retry_on_startup=True)

    def send(self, kind: str, job_id: str, shard_index: int) -> None:
        self._app.send_task(
            task_name(kind),
            args=[job_id, shard_index],
            queue=SHARD_QUEUE,
            task_id=task_id(kind, job_id, shard_index),
            headers={SENT_TS_HEADER: time.time()},
        )
