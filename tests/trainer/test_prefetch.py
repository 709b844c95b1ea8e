"""The trainer's look-ahead: while one optimizer step runs, up to `prefetch_groups` later groups load, and every
group loaded is trained once."""

import argparse
import threading
import time
from pathlib import Path

import pytest

from bench.loader import DataOnlyTrainer, data_parts, train_config, write_job
from services.trainer.data import PlannedBatch
from services.trainer.loss import Batch
from shared.settings import Settings
from shared.storage.objects import open_storage

SAMPLES = 8
LOAD_S = 0.1  # each group's load, against a 0.3 s step: every load ahead finishes while one step runs
STEP_S = 0.3


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_up_to_prefetch_groups_load_while_a_step_runs(depth: int, tmp_path: Path) -> None:
    storage = open_storage((tmp_path / "storage").as_uri(), Settings())
    job, _ = write_job(storage, hidden=64, tokens_per_sample=32, samples=SAMPLES, shard_samples=4, threads=2)
    options = argparse.Namespace(
        batch_tokens=32, tokens_per_sample=32, grad_accum=1, io_threads=2, prefetch_groups=depth
    )
    config = train_config(job, options)
    planner, loader = data_parts(config, job, storage, None)

    lock = threading.Lock()
    in_flight, most_in_flight, loaded = 0, 0, []
    load = loader.load

    def slow_load(planned: PlannedBatch, stats: object) -> Batch | None:
        nonlocal in_flight, most_in_flight
        with lock:
            in_flight += 1
            most_in_flight = max(most_in_flight, in_flight)
        try:
            time.sleep(LOAD_S)
            batch = load(planned, stats)  # type: ignore[arg-type]  # the loader's DataStats, passed through
            loaded.append(batch)
            return batch
        finally:
            with lock:
                in_flight -= 1

    loader.load = slow_load  # type: ignore[method-assign]
    trained: list[Batch] = []

    def train(batches: list[Batch]) -> None:
        trained.extend(batches)
        time.sleep(STEP_S)

    trainer = DataOnlyTrainer(config, job=job, storage=storage, planner=planner, loader=loader, train=train)
    summary = trainer.run_training()

    assert summary == {"stop_reason": "end_of_data", "steps": SAMPLES}  # one 32-token sample a batch
    assert most_in_flight == depth
    assert len(trained) == SAMPLES and sorted(map(id, trained)) == sorted(map(id, loaded))  # each loaded one trained
    assert trainer.waits_s[1:] and max(trainer.waits_s[1:]) < LOAD_S  # later steps found their data loaded
