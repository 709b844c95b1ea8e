"""The chaos soak's schedule (tests/soak/schedule.py) is a pure function of its seed and duration: the same seed
replays the same soak, and a run long enough sees every fault scenario, both job kinds and both ways of deleting."""

import itertools

from tests.soak.schedule import FAULTS, build_schedule


def test_the_same_seed_gives_the_same_schedule() -> None:
    assert build_schedule(7, 1800) == build_schedule(7, 1800)
    assert build_schedule(7, 1800) != build_schedule(8, 1800)
    assert build_schedule(7, 300) != build_schedule(7, 1800)


def test_a_30_minute_schedule_draws_every_fault_both_kinds_and_both_deletes() -> None:
    for seed in range(5):
        schedule = build_schedule(seed, 1800)
        assert {f.fault for f in schedule.faults} == set(FAULTS)
        assert {j.kind for j in schedule.jobs} == {"extract", "regenerate"}
        assert {j.delete for j in schedule.jobs} == {"no", "after_completion", "while_running"}
        assert len({j.job_id for j in schedule.jobs}) == len(schedule.jobs)


def test_faults_do_not_overlap_and_end_within_the_duration() -> None:
    for seed in range(20):
        for duration_s in (300.0, 1800.0):
            schedule = build_schedule(seed, duration_s)
            assert schedule.faults and schedule.jobs, (seed, duration_s)
            for before, after in itertools.pairwise(schedule.faults):
                assert before.at_s + before.duration_s < after.at_s
            assert all(f.at_s + f.duration_s <= duration_s for f in schedule.faults)
            assert all(0 < j.at_s <= duration_s for j in schedule.jobs)
