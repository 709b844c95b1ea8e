"""Whether a resource the soak samples is bounded: a process that keeps nothing per job stops growing once it is warm,
however many jobs it runs; one that keeps something per job (a cache keyed by job, a client per job) grows by the
same amount with every job for as long as it lives.

A figure's growth per job is the least-squares slope of its samples against the number of jobs ended, over the
first half of the jobs (after the first job ended) and over the second half. The verdict reads the second half: the
first holds the warm-up (clients, caches, allocator arenas filled on the first jobs), which is bounded by nature. A
figure is bounded when it grows by at most its threshold a job over the second half; each threshold is stated with
why below. A figure with no threshold is shown and not judged (what it holds grows with the data the soak keeps).

Short soaks are not judged: a fault's restart moves a figure by more than a few jobs' growth (a pool process
SIGKILLed takes its 40-60 MB of RSS with it, 15-20 MB a job over a half of three jobs), so a half needs
`MIN_JOBS_A_HALF` jobs before its slope says more than which faults fell in it.
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MIN_JOBS_A_HALF = 10  # a 30-minute soak ends about 50 jobs, 25 a half; a 5-minute one about 8

Sample = dict[str, Any]


@dataclass(frozen=True)
class Figure:
    name: str
    read: Callable[[Sample], float | None]
    threshold_per_job: float | None  # the most it may grow a job over the second half; None: not judged
    unjudged_because: str = ""  # with no threshold: why


@dataclass(frozen=True)
class Judgement:
    first_half_per_job: float | None
    second_half_per_job: float | None
    verdict: str  # "bounded", "growing", or "not judged: <why>"

    @property
    def growing(self) -> bool:
        return self.verdict == "growing"


def slope(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of y against x; None without two distinct x."""
    if len({x for x, _ in points}) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    covariance = sum((x - mean_x) * (y - mean_y) for x, y in points)
    variance = sum((x - mean_x) ** 2 for x, _ in points)
    return covariance / variance


def judge(
    points: Sequence[tuple[int, float]], threshold_per_job: float | None, unjudged_because: str = ""
) -> Judgement:
    """The judgement of one figure from its samples as (jobs ended, value): slopes over the halves of the jobs ended
    from the first to the last, the verdict from the second half's."""
    ended = [jobs for jobs, _ in points if jobs >= 1]
    if not ended:
        return Judgement(None, None, "not judged: no job ended")
    first, last = min(ended), max(ended)
    middle = (first + last) / 2
    first_half = slope([(x, y) for x, y in points if first <= x <= middle])
    second_half = slope([(x, y) for x, y in points if middle <= x <= last])
    if threshold_per_job is None:
        verdict = f"not judged: {unjudged_because}"
    elif last - middle < MIN_JOBS_A_HALF:
        verdict = f"not judged: {last} jobs ended, too few ({MIN_JOBS_A_HALF} a half needed)"
    elif second_half is None:
        verdict = "not judged: no sample in the second half"
    else:
        verdict = "bounded" if second_half <= threshold_per_job else "growing"
    return Judgement(first_half, second_half, verdict)


def judge_figure(figure: Figure, samples: Sequence[Sample]) -> Judgement:
    points = [(int(s["jobs_finished"]), value) for s in samples if (value := figure.read(s)) is not None]
    return judge(points, figure.threshold_per_job, figure.unjudged_because)


MB = 1_000_000
# RSS, for each process of a figure: 1 MB a job is 1 GB over a thousand jobs, and about what a 30-minute soak resolves
# (a shard in flight at a sample holds tens of MB; the slope over 25 jobs averages that out). A pool process that
# only extracts still gains about 0.5 MB a job after its first ten, less and less (its allocator's arenas).
RSS_PER_JOB_A_PROCESS = 1 * MB
# Open descriptors of a process: one more every other job would be a descriptor kept per job (a file, a connection).
FDS_PER_JOB = 0.5


def figures(fd_groups: Sequence[str], processes: Mapping[str, int]) -> list[Figure]:
    """The soak's resource figures, with their thresholds. `fd_groups`: the stack's process names (the worker
    processes as one) with open descriptors sampled; `processes`: how many processes each RSS figure sums."""

    def rss(part: str) -> float:
        return RSS_PER_JOB_A_PROCESS * max(processes.get(part, 1), 1)

    kept_data = "the kept jobs' data (the audit checks that nothing else is stored)"
    return [
        # Every job the soak keeps keeps its Redis hash, its committed-shard set and its trimmed event stream (three
        # keys, 7-8 KB for the soak's regenerate jobs); a deleted job keeps none; leases and broker keys come and go.
        Figure("Redis used_memory (bytes)", lambda s: s.get("redis_used_memory"), 16_000),
        Figure("Redis keys", lambda s: s.get("redis_keys"), 3.5),
        Figure(
            "open fds, all stack processes",
            lambda s: s.get("open_fds_total"),
            None,
            "the sum of the rows below, the test's S3 server's included",
        ),
        *[
            Figure(
                f"open fds, {group}",
                (lambda g: lambda s: s["open_fds"].get(g))(group),
                None if group == "s3" else FDS_PER_JOB,
                "the test's S3 server (SeaweedFS, not eagle3): its volume files follow the data kept",
            )
            for group in fd_groups
        ],
        Figure("worker RSS (bytes, main processes)", lambda s: s["rss"].get("worker_main"), rss("worker_main")),
        Figure("worker RSS (bytes, pool processes)", lambda s: s["rss"].get("worker_pool"), rss("worker_pool")),
        Figure("worker RSS (bytes, 2 workers + pools)", lambda s: s.get("worker_rss"), rss("worker")),
        Figure("inference RSS (bytes)", lambda s: s["rss"].get("inference"), rss("inference")),
        Figure("producer RSS (bytes)", lambda s: s["rss"].get("producer"), rss("producer")),
        Figure("storage bytes", lambda s: s.get("storage_bytes"), None, kept_data),
        Figure("storage objects", lambda s: s.get("storage_objects"), None, kept_data),
    ]
