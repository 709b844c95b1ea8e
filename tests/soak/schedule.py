"""The soak's seeded schedule, a pure function of (seed, duration): when each job is submitted (its kind, size and
whether the soak deletes it) and when each fault is injected. The same seed and duration give the same schedule,
so a failing soak replays with `--seed`.

Faults are drawn from the fault suite's scenarios (tests/faults) in rounds: each round is a seeded shuffle of every
scenario, so a run long enough sees each of them; one that does not fit in the time left is skipped. Faults do not
overlap: the next starts a random gap after the previous one ended.
"""

import random
from dataclasses import asdict, dataclass
from typing import Literal

# name -> how long the fault lasts (s); 0: a single event (a kill), after which the supervisor restarts the process.
FAULTS: dict[str, float] = {
    "worker_sigkill": 0.0,  # a whole worker (main process and pool) SIGKILLed at once
    "pool_child_sigkill": 0.0,  # a worker's pool process SIGKILLed (preferably one running a shard)
    "redis_sigkill": 0.0,  # Redis SIGKILLed, restarted by the supervisor on its append-only file
    "redis_sigterm": 0.0,  # Redis stopped gracefully (compose restart), restarted by the supervisor
    "redis_outage_3min": 180.0,  # Redis stopped and kept down for 3 minutes, longer than EAGLE3_REDIS_OUTAGE_WAIT_S
    "s3_errors": 24.0,  # through the S3 proxy: reset mid-upload, 503 SlowDown, slow responses (8 s each)
    "s3_unreachable": 30.0,  # the S3 proxy refuses connections
    "s3_full": 40.0,  # the S3 proxy answers 507 to every write
    "inference_sigkill": 0.0,  # the inference server SIGKILLed, restarted by the supervisor
    "inference_hang": 90.0,  # the inference server SIGSTOPped (port open, nothing answers), SIGCONT after
    "producer_sigkill": 0.0,  # the producer SIGKILLed, restarted by the supervisor
}
S3_ERROR_MODES = ("reset", "slowdown", "slow")

FIRST_FAULT_S = (15.0, 30.0)
FAULT_GAP_S = (15.0, 45.0)  # from the end of one fault to the start of the next
JOB_GAP_S = (15.0, 45.0)  # between two submissions: the two workers are busy most of the time
SUBMIT_WINDOW = 0.85  # jobs are submitted in the first 85 % of the duration
DELETE_SHARE = 0.15  # about one job in seven is deleted by the soak
DELETE_WHILE_RUNNING_AFTER_S = (8.0, 25.0)  # after its submit, a `while_running` delete (with cancel) is asked

Kind = Literal["extract", "regenerate"]
Delete = Literal["no", "after_completion", "while_running"]


@dataclass(frozen=True)
class JobPlan:
    at_s: float  # submit time, from the start of the soak
    job_id: str
    kind: Kind
    conversations: int
    data_seed: int  # the demo dataset's seed
    delete: Delete = "no"
    delete_after_s: float = 0.0  # while_running: from the submit to the delete

    def spec(self) -> dict[str, object]:
        """The job's submit fields besides the dataset: small jobs of several shards (extract: 40-90 conversations,
        7k-16k SmolLM2 tokens in shards of 1,000 tokens, 15-30 s on two CPU workers; regenerate: 4-8 conversations,
        2 a shard, 16 new tokens a turn), so that a 2-core machine runs dozens of them in a soak."""
        if self.kind == "extract":
            return {"job_id": self.job_id, "shard_token_budget": 1000}
        return {"job_id": self.job_id, "kind": "regenerate", "max_new_tokens": 16, "conversations_per_shard": 2}


@dataclass(frozen=True)
class FaultPlan:
    at_s: float
    fault: str
    duration_s: float
    detail: str = ""  # the worker to kill, the order of the S3 error modes


@dataclass(frozen=True)
class Schedule:
    seed: int
    duration_s: float
    jobs: tuple[JobPlan, ...]
    faults: tuple[FaultPlan, ...]

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def build_schedule(seed: int, duration_s: float, *, workers: int = 2) -> Schedule:
    # Separate streams, so that the faults drawn do not depend on how many jobs were drawn before them.
    return Schedule(
        seed=seed,
        duration_s=duration_s,
        jobs=tuple(_jobs(random.Random(f"jobs-{seed}"), seed, duration_s)),
        faults=tuple(_faults(random.Random(f"faults-{seed}"), duration_s, workers)),
    )


def _jobs(rng: random.Random, seed: int, duration_s: float) -> list[JobPlan]:
    times: list[float] = []
    t = 5.0
    while t <= duration_s * SUBMIT_WINDOW:
        times.append(round(t, 1))
        t += rng.uniform(*JOB_GAP_S)
    kinds: list[Kind] = [rng.choice(("extract", "extract", "regenerate")) for _ in times]
    if len(times) >= 2 and len(set(kinds)) == 1:  # both kinds in every soak of two jobs or more
        kinds[1] = "regenerate" if kinds[0] == "extract" else "extract"
    deletes: list[Delete] = [
        rng.choice(("after_completion", "while_running")) if rng.random() < DELETE_SHARE else "no" for _ in times
    ]
    # Both ways of deleting in every soak of four jobs or more (one in a soak of three).
    for way in ("after_completion", "while_running")[: max(min(len(times) - 2, 2), 0)]:
        if way not in deletes:
            free = [i for i, d in enumerate(deletes) if d == "no"]
            deletes[free[rng.randrange(len(free))]] = way
    jobs = []
    for i, (at_s, kind, delete) in enumerate(zip(times, kinds, deletes, strict=True)):
        conversations = rng.randint(40, 90) if kind == "extract" else rng.randint(4, 8)
        jobs.append(
            JobPlan(
                at_s=at_s,
                job_id=f"soak-s{seed}-{i:02d}-{kind}",
                kind=kind,
                conversations=conversations,
                data_seed=rng.randrange(1_000_000),
                delete=delete,
                delete_after_s=round(rng.uniform(*DELETE_WHILE_RUNNING_AFTER_S), 1) if delete == "while_running" else 0,
            )
        )
    return jobs


def _faults(rng: random.Random, duration_s: float, workers: int) -> list[FaultPlan]:
    faults: list[FaultPlan] = []
    t = rng.uniform(*FIRST_FAULT_S)
    bag: list[str] = []
    refilled = False
    while t < duration_s:
        fitting = [name for name in bag if t + FAULTS[name] <= duration_s]
        if not fitting:
            if refilled:  # a fresh round has nothing that fits either: the time is up
                break
            bag, refilled = rng.sample(sorted(FAULTS), len(FAULTS)), True
            continue
        name = fitting[0]
        bag.remove(name)
        refilled = False
        detail = ""
        if name in ("worker_sigkill", "pool_child_sigkill"):
            detail = f"worker-{rng.randint(1, workers)}"  # the fallback when no worker runs a shard
        elif name == "s3_errors":
            detail = ",".join(rng.sample(S3_ERROR_MODES, len(S3_ERROR_MODES)))
        faults.append(FaultPlan(round(t, 1), name, FAULTS[name], detail))
        t += FAULTS[name] + rng.uniform(*FAULT_GAP_S)
    return faults
