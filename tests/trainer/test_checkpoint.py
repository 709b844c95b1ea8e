"""The checkpoint record: it round-trips through bytes exactly, loads with weights_only=True, and a payload with a
missing or wrong field is refused with the field named."""

import io
from collections import Counter
from pathlib import Path

import pytest
import torch

from services.trainer.checkpoint import (
    CHECKPOINT_FORMAT,
    Checkpoint,
    RankState,
    capture_rng_state,
    load_checkpoint,
    save_checkpoint,
)
from services.trainer.config import TrainConfig
from services.trainer.data import DataPosition, DataStats
from services.trainer.drafter import DrafterConfig
from shared.errors import ConfigurationError
from shared.storage.objects import open_storage


def small_checkpoint(step: int = 7) -> Checkpoint:
    drafter_config = DrafterConfig(
        hidden_size=8,
        intermediate_size=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=64,
        vocab_size=32,
        draft_vocab_size=16,
        target_hidden_size=8,
        aux_layer_ids=[0, 1, 2],
    )
    return Checkpoint(
        job_id="job-1",
        run_name="run",
        step=step,
        saved_at="2026-12-01T00:00:00.000+00:00",
        model_path="/models/target",
        drafter_config=drafter_config,
        train_config=TrainConfig(job_id="job-1", run_name="run", lr=3e-3),
        drafter={"fc.weight": torch.randn(8, 24), "d2t": torch.zeros(16, dtype=torch.long)},
        optimizer={"state": {}, "param_groups": [{"lr": 3e-3, "params": [0]}]},
        scheduler={"last_epoch": step},
        schedule_steps=100,
        data_position=DataPosition(seed=0, epoch=1, epoch_shards=[3, 1, 2], next_batch=4),
        ranks=[RankState(rng=capture_rng_state(), data_stats=DataStats(5, 50, Counter({"sha256": 1})))],
        train_tokens=1234,
        train_seconds=5.5,
        history=[{"step": step, "loss": 1.0}],
    )


def test_a_saved_checkpoint_loads_back_equal(tmp_path: Path) -> None:
    storage = open_storage((tmp_path / "store").as_uri())
    original = small_checkpoint()
    key = save_checkpoint(storage, original, keep=2)
    for ref in (key, "job-1/trainer/run", "job-1/trainer/run/checkpoints/latest.json"):
        loaded = load_checkpoint(ref, storage)
        assert loaded.source == key
        assert torch.equal(loaded.drafter["fc.weight"], original.drafter["fc.weight"])
        assert loaded.ranks[0].data_stats == original.ranks[0].data_stats
        assert torch.equal(loaded.ranks[0].rng["torch"], original.ranks[0].rng["torch"])
        loaded.drafter, loaded.ranks = original.drafter, original.ranks  # tensors compared above
        assert loaded == original
    # Only tensors and plain values: the bytes load with weights_only=True, as a plain dict.
    payload = torch.load(io.BytesIO(storage.get(key)), weights_only=True)
    assert payload["format"] == CHECKPOINT_FORMAT and payload["train_config"]["lr"] == 3e-3


def test_old_checkpoints_are_pruned_to_the_newest(tmp_path: Path) -> None:
    storage = open_storage((tmp_path / "store").as_uri())
    for step in (1, 2, 3):
        save_checkpoint(storage, small_checkpoint(step), keep=2)
    assert [k.rsplit("/", 1)[1] for k in storage.list("job-1/trainer/run/checkpoints/step_")] == [
        "step_00000002.pt",
        "step_00000003.pt",
    ]
    assert load_checkpoint("job-1/trainer/run", storage).step == 3


def test_a_payload_missing_a_field_is_refused_naming_it() -> None:
    payload = small_checkpoint().to_payload()
    del payload["schedule_steps"]
    with pytest.raises(ConfigurationError, match=r"checkpoint x\.pt: field 'schedule_steps' is missing"):
        Checkpoint.from_payload(payload, source="x.pt")
    with pytest.raises(ConfigurationError, match="not a format-1 trainer checkpoint"):
        Checkpoint.from_payload({"format": 99}, source="x.pt")


def test_a_checkpoint_of_an_earlier_version_loads_without_its_retired_settings() -> None:
    # Saved before --recompute-logits was retired: the setting no longer exists and changes nothing, so it is dropped.
    payload = small_checkpoint().to_payload()
    payload["train_config"]["recompute_logits"] = True
    payload["drafter_config"]["recompute_logits"] = True
    loaded = Checkpoint.from_payload(payload, source="x.pt")
    assert loaded.train_config == small_checkpoint().train_config
    assert not hasattr(loaded.drafter_config, "recompute_logits")
