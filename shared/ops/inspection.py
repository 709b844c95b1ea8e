"""What an operator drills into on a job's page: its dead-lettered shards with their reasons, where it is stored,
and the trainer runs that follow it (their latest checkpoint and training curves)."""

import json
import re

from pydantic import BaseModel

from shared.lifecycle.schemas import DeadLetter
from shared.storage import layout
from shared.storage.objects import Storage

RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class TrainerRun(BaseModel):
    run_name: str
    latest_step: int | None  # None until its first checkpoint
    saved_at: str | None
    has_curves: bool


def storage_root(storage: Storage, job_id: str) -> str:
    return f"{storage.url.rstrip('/')}/{job_id}/"


def dead_letters(storage: Storage, job_id: str, *, limit: int = 500) -> list[DeadLetter]:
    """The first `limit` dead-lettered shards, by shard index (a resumed and committed shard keeps its record)."""
    keys = storage.list(layout.dead_letter_prefix(job_id))[:limit]
    return [DeadLetter.model_validate_json(storage.get(key)) for key in keys]


def trainer_runs(storage: Storage, job_id: str) -> list[TrainerRun]:
    prefix = layout.trainer_prefix(job_id)
    names = sorted({key[len(prefix) :].split("/", 1)[0] for key in storage.list(prefix)})
    runs = []
    for name in names:
        if not re.match(RUN_NAME_PATTERN, name):
            continue
        latest = {}
        if storage.exists(layout.trainer_latest(job_id, name)):
            latest = json.loads(storage.get(layout.trainer_latest(job_id, name)))
        runs.append(
            TrainerRun(
                run_name=name,
                latest_step=latest.get("step"),
                saved_at=latest.get("saved_at"),
                has_curves=storage.exists(layout.trainer_curves(job_id, name)),
            )
        )
    return runs
