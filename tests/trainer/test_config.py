"""The `eagle3 train` flags come from TrainConfig: every field can be set, only what is given is passed on (so a
resumed run can tell an explicit value from a default), and a bad value names its flag."""

import argparse
import itertools

import pytest
import torch

from services.trainer import cli as trainer_cli
from services.trainer.config import (
    RESUME_OVERRIDES,
    TrainConfig,
    compiles_backbone,
    config_from_args,
    resumed_config,
)
from services.trainer.step import TrainClock, build_scheduler
from shared.errors import ConfigurationError


def train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    trainer_cli.add_parsers(parser.add_subparsers())
    return parser


def test_every_config_field_but_the_job_has_a_flag() -> None:
    assert train_parser().parse_args(["train", "--job", "j"]).job == "j"  # the job is the only required flag
    flags = {
        option
        for action in train_parser()._subparsers._group_actions[0].choices["train"]._actions  # type: ignore[union-attr]
        for option in action.option_strings
    }
    for name in TrainConfig.model_fields:
        if name != "job_id":
            assert f"--{name.replace('_', '-')}" in flags, name


def test_flags_of_every_kind_reach_the_config_and_nothing_else_does() -> None:
    args = train_parser().parse_args(
        [
            *("train", "--job", "j", "--warmup-ratio", "0.2", "--min-lr-ratio", "0", "--max-grad-norm", "1.5"),
            *("--betas", "0.8", "0.99", "--aux-layer-ids", "1", "4", "6", "--no-sort-by-length", "--device", "cpu"),
            *("--model", "/models/target", "--random-init", "--max-seconds", "30"),
        ]
    )
    config = config_from_args(args, job_id="j")
    assert config.warmup_ratio == 0.2 and config.min_lr_ratio == 0.0 and config.max_grad_norm == 1.5
    assert config.betas == (0.8, 0.99) and config.aux_layer_ids == [1, 4, 6]
    assert config.sort_by_length is False and config.device == "cpu" and config.init_from_target is False
    assert config.model_path == "/models/target" and config.max_seconds == 30.0
    assert config.model_fields_set == {
        "job_id",
        "warmup_ratio",
        "min_lr_ratio",
        "max_grad_norm",
        "betas",
        "aux_layer_ids",
        "sort_by_length",
        "device",
        "model_path",
        "init_from_target",
        "max_seconds",
    }


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        pytest.param(["--warmup-ratio", "1.5"], "--warmup-ratio: Input should be less than 1", id="out-of-range"),
        pytest.param(["--run-name", "../x"], "--run-name: String should match pattern", id="bad-pattern"),
    ],
)
def test_a_bad_value_names_its_flag(flags: list[str], message: str) -> None:
    args = train_parser().parse_args(["train", "--job", "j", *flags])
    with pytest.raises(ConfigurationError, match=message):
        config_from_args(args, job_id="j")


def test_resuming_keeps_what_would_change_the_next_steps() -> None:
    saved = TrainConfig(job_id="j", lr=1e-3, max_steps=10, warmup_ratio=0.1)
    given = TrainConfig(job_id="j", lr=5e-4, max_steps=20, run_name="again")
    resumed = resumed_config(saved, given)
    assert "max_steps" in RESUME_OVERRIDES and "lr" not in RESUME_OVERRIDES
    assert (resumed.lr, resumed.max_steps, resumed.warmup_ratio, resumed.run_name) == (1e-3, 20, 0.1, "again")


def _scheduler_lrs(config: TrainConfig, clock: TrainClock, seconds: list[float]) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=config.lr)
    scheduler = build_scheduler(optimizer, config, total_steps=1000, clock=clock)
    lrs = []
    for elapsed in seconds:
        clock.seconds = elapsed
        optimizer.step()
        scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
    return lrs


def test_a_run_bounded_by_time_decays_its_learning_rate_to_the_minimum_when_its_time_runs_out() -> None:
    # 100 steps of a 1000-step estimate: by steps alone the cosine would have barely started.
    timed = TrainConfig(job_id="job", lr=1e-3, min_lr_ratio=0.1, warmup_ratio=0.01, max_seconds=100.0)
    seconds = [i + 1.0 for i in range(100)]
    lrs = _scheduler_lrs(timed, TrainClock(), seconds)
    assert lrs[8] == pytest.approx(1e-3)  # warmup (10 steps) goes by steps, whatever the time
    assert lrs[49] == pytest.approx(5.5e-4)  # half the time: half way down the cosine (0.1 + 0.9 / 2)
    assert lrs[-1] == pytest.approx(1e-4)  # the minimum, at the end of the budget
    assert all(a >= b for a, b in itertools.pairwise(lrs[10:]))
    # Given a step count, the schedule follows steps only.
    by_steps = TrainConfig(
        job_id="job", lr=1e-3, min_lr_ratio=0.1, warmup_ratio=0.01, max_seconds=100.0, max_steps=1000
    )
    assert _scheduler_lrs(by_steps, TrainClock(), seconds)[-1] > 9e-4


@pytest.mark.parametrize(
    ("flags", "on_cuda", "on_cpu"),
    [([], True, False), (["--compile-backbone"], True, True), (["--no-compile-backbone"], False, False)],
)
def test_the_backbone_is_compiled_on_cuda_unless_told_otherwise(flags: list[str], on_cuda: bool, on_cpu: bool) -> None:
    config = config_from_args(train_parser().parse_args(["train", "--job", "j", *flags]), job_id="j")
    assert (compiles_backbone(config, "cuda"), compiles_backbone(config, "cpu")) == (on_cuda, on_cpu)
