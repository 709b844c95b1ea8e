"""The chaos soak's resource verdicts (tests/soak/resources.py): a figure that grows with every job fails the soak, one
that grows while it warms up and then stays passes, and a soak too short to tell either from a fault's restart
judges neither."""

import random

import pytest

from tests.soak.resources import (
    MB,
    MIN_JOBS_A_HALF,
    RSS_PER_JOB_A_PROCESS,
    Figure,
    figures,
    judge,
    judge_figure,
    slope,
)


def series(jobs: int, value_after: object, *, seed: int = 0, noise: float = 20 * MB) -> list[tuple[int, float]]:
    """A soak's samples as (jobs ended, value): a few samples per job ended, each off by up to `noise` (a shard in
    flight at the sample), the value a function of the jobs ended."""
    rng = random.Random(seed)
    return [
        (ended, value_after(ended) + rng.uniform(-noise, noise))  # type: ignore[operator]
        for ended in range(jobs + 1)
        for _ in range(rng.randint(1, 3))
    ]


def test_slope_is_the_least_squares_slope() -> None:
    assert slope([(0, 1.0), (1, 3.0), (2, 5.0)]) == pytest.approx(2.0)
    assert slope([(0, 0.0), (1, 1.0), (1, 3.0), (2, 2.0)]) == pytest.approx(1.0)
    assert slope([(3, 1.0), (3, 2.0)]) is None


def test_memory_kept_per_job_is_growing() -> None:
    # What the worker pools did with every job's tokenizer kept: about 6 MB a job on average, for as long as they ran.
    leak = series(50, lambda jobs: 1_000 * MB + 6 * MB * jobs)
    judgement = judge(leak, RSS_PER_JOB_A_PROCESS)
    assert judgement.verdict == "growing" and judgement.growing
    assert judgement.second_half_per_job == pytest.approx(6 * MB, rel=0.3)


def test_a_leak_starting_late_is_growing() -> None:
    late = series(50, lambda jobs: 1_000 * MB + 4 * MB * max(jobs - 25, 0))
    judgement = judge(late, RSS_PER_JOB_A_PROCESS)
    assert judgement.growing
    assert judgement.first_half_per_job is not None and judgement.first_half_per_job < RSS_PER_JOB_A_PROCESS


def test_warm_up_then_flat_is_bounded() -> None:
    # Clients, caches and allocator arenas filled over the first jobs, then nothing more whatever the jobs.
    plateau = series(50, lambda jobs: 1_000 * MB + 150 * MB * min(jobs, 12) / 12)
    judgement = judge(plateau, RSS_PER_JOB_A_PROCESS)
    assert judgement.verdict == "bounded" and not judgement.growing
    assert judgement.first_half_per_job is not None and judgement.first_half_per_job > RSS_PER_JOB_A_PROCESS


def test_a_restart_in_the_second_half_does_not_make_a_figure_growing() -> None:
    # A pool process SIGKILLed at the 40th job and started again: 60 MB gone, then warm again over a few jobs.
    restarted = series(50, lambda jobs: 1_000 * MB - (60 * MB if 40 <= jobs < 43 else 0))
    assert judge(restarted, RSS_PER_JOB_A_PROCESS).verdict == "bounded"


def test_a_short_soak_is_not_judged() -> None:
    # The 3-minute soak of `make test`: six jobs, so three a half, where one restart outweighs any growth.
    leak = series(6, lambda jobs: 1_000 * MB + 6 * MB * jobs)
    judgement = judge(leak, RSS_PER_JOB_A_PROCESS)
    assert judgement.verdict.startswith("not judged: 6 jobs ended") and not judgement.growing
    enough = 2 * MIN_JOBS_A_HALF + 1
    assert judge(series(enough, lambda jobs: 6 * MB * jobs), RSS_PER_JOB_A_PROCESS).growing


def test_a_figure_without_threshold_is_shown_not_judged() -> None:
    stored = Figure("storage bytes", lambda s: s.get("storage_bytes"), None, "the kept jobs' data")
    samples = [{"jobs_finished": jobs, "storage_bytes": 17 * MB * jobs} for jobs in range(51)]
    judgement = judge_figure(stored, samples)
    assert judgement.verdict == "not judged: the kept jobs' data"
    assert judgement.second_half_per_job == pytest.approx(17 * MB)


def test_samples_where_a_figure_could_not_be_read_are_left_out() -> None:
    # Redis down at some samples (an outage): its figures are None there.
    keys = Figure("Redis keys", lambda s: s.get("redis_keys"), 3.5)
    samples = [{"jobs_finished": jobs, "redis_keys": None if jobs % 7 == 0 else 8 + 3 * jobs} for jobs in range(51)]
    judgement = judge_figure(keys, samples)
    assert judgement.verdict == "bounded" and judgement.second_half_per_job == pytest.approx(3.0)


def test_the_rss_limit_is_per_process_of_the_figure() -> None:
    by_name = {f.name: f for f in figures(["redis", "s3", "worker"], {"worker_pool": 2, "inference": 1})}
    pools = by_name["worker RSS (bytes, pool processes)"]
    assert pools.threshold_per_job == 2 * RSS_PER_JOB_A_PROCESS
    assert by_name["inference RSS (bytes)"].threshold_per_job == RSS_PER_JOB_A_PROCESS
    assert by_name["open fds, s3"].threshold_per_job is None and by_name["open fds, redis"].threshold_per_job

    def pool_samples(per_job: float) -> list[dict]:
        return [{"jobs_finished": j, "rss": {"worker_pool": 600 * MB + per_job * j}} for j in range(51)]

    assert judge_figure(pools, pool_samples(1.5 * MB)).verdict == "bounded"  # two processes, 0.75 MB a job each
    assert judge_figure(pools, pool_samples(2.5 * MB)).growing
