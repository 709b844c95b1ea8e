"""The chaos soak over real processes: a `LocalStack` (Redis with its append-only file, the reference inference server
with SmolLM2-135M-Instruct, two `eagle3 worker` processes, the producer) on a SeaweedFS of its own, reached through
the fault suite's S3 proxy; every delivery setting at its production default.

Three threads besides the main one: the supervisor (`LocalStack.supervise()` every half second, the restart policy
of `eagle3 up`), the injector (the schedule's faults, one at a time) and the main thread, which submits the jobs,
deletes those the schedule deletes, samples resources, then waits for every job to end on its own (nothing is ever
resumed by hand), audits each from storage and prints the tables.
"""

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import threading
import time
import traceback
import uuid
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
import redis
from rich.console import Console
from rich.table import Table

from eagle3.local_stack import LocalStack
from shared.data.demo_data import write_demo_dataset
from shared.data.model_assets import ensure_smollm2
from shared.errors import JobNotFound
from shared.lifecycle import leases, progress
from shared.settings import Settings
from shared.storage import layout
from shared.storage.objects import open_storage
from tests.faults.audit import Audit, audit_job, audit_regenerate_job
from tests.faults.fault_proxy import FaultProxy
from tests.faults.stack import FaultStack
from tests.fixtures.processes import free_port
from tests.fixtures.seaweedfs import ACCESS_KEY, REGION, SECRET_KEY, WeedMini
from tests.fixtures.smollm2 import MODELS_DIR
from tests.soak.resources import figures as resource_figures
from tests.soak.resources import judge_figure
from tests.soak.schedule import FaultPlan, JobPlan, Schedule, build_schedule

WORKERS = 2
SUPERVISE_EVERY_S = 0.5
SAMPLE_EVERY_S = 30.0
RETRY_SUBMIT_S = 5.0
RETRY_DELETE_S = 10.0
FINISHED = ("completed", "completed_with_errors", "cancelled")


def _now_s(start: float) -> float:
    return round(time.monotonic() - start, 1)


def _utc() -> str:
    return datetime.now(UTC).strftime("%H:%M:%S")


@dataclass
class JobRun:
    plan: JobPlan
    dataset: Path
    submit_attempts: int = 0
    submit_errors: list[str] = field(default_factory=list)
    submitted_s: float | None = None
    next_try_s: float = 0.0
    finished_s: float | None = None
    state: str | None = None
    samples_done: int = 0
    samples_total: int = 0
    shards_rerun: int = 0
    shards_dead_lettered: int = 0
    delete_attempts: int = 0
    delete_errors: list[str] = field(default_factory=list)
    deleted_s: float | None = None
    next_delete_s: float = 0.0
    audit: Audit | None = None
    checks: list[str] = field(default_factory=list)  # what failed in the final verification

    @property
    def settled(self) -> bool:
        if self.plan.delete != "no":
            return self.deleted_s is not None
        return self.finished_s is not None


@dataclass
class FaultRun:
    plan: FaultPlan
    started_s: float | None = None
    ended_s: float | None = None
    target: str = ""
    note: str = ""
    error: str = ""
    supervisor: list[str] = field(default_factory=list)  # the supervisor's lines while the fault lasted


class Soak:
    def __init__(self, schedule: Schedule, *, run_dir: Path, report_path: Path, drain_s: float) -> None:
        self.schedule, self.run_dir, self.report_path, self.drain_s = schedule, run_dir, report_path, drain_s
        self.console = Console(width=200)
        self.lock = threading.Lock()  # around the stack's process list: the supervisor and the injector
        self.stop_event = threading.Event()
        self.injector_done = threading.Event()
        self.jobs: list[JobRun] = []
        self.faults: list[FaultRun] = [FaultRun(f) for f in schedule.faults]
        self.supervisor_lines: list[tuple[float, str]] = []
        self.samples: list[dict[str, Any]] = []
        self.progress_changes: list[tuple[float, str, int]] = []  # (time, job, samples_done)
        self.errors: list[str] = []
        self.start = 0.0
        self._verified = threading.Event()  # the supervisor runs until the final verification is over

    # ---- setup ------------------------------------------------------------------------------------------------

    def run(self) -> bool:
        logging.getLogger("eagle3.local_stack").setLevel(logging.ERROR)  # the soak prints the supervisor's lines
        if self.run_dir.exists():
            shutil.rmtree(self.run_dir)
        (self.run_dir / "data").mkdir(parents=True)
        self.console.print(
            f"[bold]chaos soak[/bold] seed={self.schedule.seed} duration={self.schedule.duration_s / 60:.0f} min: "
            f"{len(self.schedule.jobs)} jobs, {len(self.schedule.faults)} faults; logs in {self.run_dir}/logs"
        )
        for plan in self.schedule.jobs:
            dataset = (self.run_dir / "data" / f"{plan.job_id}.jsonl").resolve()
            write_demo_dataset(dataset, num_conversations=plan.conversations, seed=plan.data_seed)
            self.jobs.append(JobRun(plan, dataset))
        os.environ.update(
            {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": REGION}
        )
        weed_dir = self.run_dir / "weed"
        weed_dir.mkdir()
        self.weed = WeedMini.plan(weed_dir)
        self.weed.start({**os.environ, "TMPDIR": str(weed_dir)}, self.run_dir / "weed.log")
        self.proxy = FaultProxy(int(self.weed.server.endpoint_url.rsplit(":", 1)[1]))
        self.proxy.start()
        wall_start = time.monotonic()
        try:
            return self._with_stack()
        finally:
            self.proxy.stop()
            self.weed.stop()
            shutil.rmtree(weed_dir, ignore_errors=True)  # the stored data; the logs stay in the run folder
            self.console.print(f"wall time {(time.monotonic() - wall_start) / 60:.1f} min (stack up to stack down)")

    def _with_stack(self) -> bool:
        home = (self.run_dir / "home").resolve()
        home.mkdir(parents=True)
        settings = Settings(
            redis_url=f"redis://127.0.0.1:{free_port()}/0",
            storage_url=f"s3://{self.weed.server.bucket}/soak-{uuid.uuid4().hex[:8]}",
            s3_endpoint_url=self.proxy.endpoint_url,  # every process of the stack goes through the fault proxy
            model_path=ensure_smollm2(MODELS_DIR),
            home=home,
            inference_device="cpu",
            worker_heartbeat_file=home / "heartbeat",
            dataset_roots=[str((self.run_dir / "data").resolve())],
        )
        self.settings = settings
        log_dir = (self.run_dir / "logs").resolve()
        with LocalStack(settings, workers=WORKERS, log_dir=log_dir, pick_free_ports=True) as stack:
            # The soak reads storage directly, never through the proxy.
            direct = settings.model_copy(update={"s3_endpoint_url": self.weed.server.endpoint_url})
            self.fs = FaultStack(stack, settings, open_storage(settings.storage_url, direct))
            self.s3 = self.weed.server.client()
            self.bucket, self.root = settings.storage_url.removeprefix("s3://").split("/", 1)
            self.start = time.monotonic()
            self.samples.append(self._measure("start"))
            supervisor = threading.Thread(target=self._supervise, name="supervisor", daemon=True)
            injector = threading.Thread(target=self._inject, name="injector", daemon=True)
            supervisor.start()
            injector.start()
            try:
                self._drive()
            finally:
                self.stop_event.set()
                injector.join(timeout=300)
                self._drain_until_settled()
                self.samples.append(self._measure("end"))
                try:
                    self._verify()
                finally:
                    self._verified.set()
                supervisor.join(timeout=10)
            wall_s = time.monotonic() - self.start
        passed = self._report(wall_s)
        return passed

    # ---- the supervisor ---------------------------------------------------------------------------------------

    def _supervise(self) -> None:
        while not self._verified.is_set():
            with self.lock:
                try:
                    lines = self.fs.stack.supervise()
                except Exception as exc:  # keep supervising whatever one restart did
                    lines = [f"supervise failed: {exc!r}"]
            self._supervised(lines)
            time.sleep(SUPERVISE_EVERY_S)

    def _supervised(self, lines: list[str]) -> None:
        for line in lines:
            self.supervisor_lines.append((_now_s(self.start), line))
            self.console.print(f"[dim]{_utc()} +{_now_s(self.start):6.0f}s supervisor: {line}[/dim]")

    # ---- the injector -----------------------------------------------------------------------------------------

    def _inject(self) -> None:
        try:
            for fault in self.faults:
                if self._sleep_until(fault.plan.at_s):
                    break
                fault.started_s = _now_s(self.start)
                lines_before = len(self.supervisor_lines)
                self.console.print(
                    f"[yellow]{_utc()} +{fault.started_s:6.0f}s fault {fault.plan.fault}[/yellow] {fault.plan.detail}"
                )
                try:
                    self._apply(fault)
                except Exception as exc:
                    fault.error = f"{type(exc).__name__}: {exc}"
                    self.errors.append(f"fault {fault.plan.fault} at {fault.started_s}s: {fault.error}")
                    traceback.print_exc()
                fault.ended_s = _now_s(self.start)
                fault.supervisor = [line for _, line in self.supervisor_lines[lines_before:]]
                self.console.print(
                    f"[yellow]{_utc()} +{fault.ended_s:6.0f}s fault {fault.plan.fault} over[/yellow] "
                    f"{fault.target} {fault.note}"
                )
        finally:
            self.proxy.fault = "none"
            self.proxy.listen(True)
            self.injector_done.set()

    def _sleep_until(self, at_s: float) -> bool:
        """Sleep until `at_s` into the soak; True if the soak is stopping."""
        return self.stop_event.wait(max(self.start + at_s - time.monotonic(), 0))

    def _hold(self, seconds: float) -> None:
        self.stop_event.wait(seconds)  # a fault cut short when the soak stops (the main thread failed)

    def _busy_worker(self, fallback: str) -> str:
        """A worker that holds a shard lease now (the fault then hits a shard mid-run), else the fallback."""
        with contextlib.suppress(redis.RedisError):
            holders = sorted({self.fs.holder_name(lease) or "" for lease in leases.held(self.fs.redis)} - {""})
            workers = [h for h in holders if h.startswith("worker-")]
            if workers:
                return workers[0] if fallback not in workers else fallback
        return fallback

    def _apply(self, fault: FaultRun) -> None:
        name, fs = fault.plan.fault, self.fs
        if name == "worker_sigkill":
            fault.target = self._busy_worker(fault.plan.detail)
            with self.lock:
                fs.kill_whole(fault.target)
        elif name == "pool_child_sigkill":
            fault.target = self._busy_worker(fault.plan.detail)
            with self.lock:
                children = psutil.Process(fs.process(fault.target).pid).children()
                if not children:
                    fault.note = "no pool process (the worker was starting): nothing killed"
                    return
                children[0].kill()
                fault.note = f"pool pid {children[0].pid}"
        elif name in ("redis_sigkill", "redis_sigterm"):
            fault.target = "redis"
            with self.lock:
                if name == "redis_sigkill":
                    fs.kill_whole("redis")
                else:
                    fs.stop("redis", signal.SIGTERM)
            fault.note = self._wait_redis(60)
        elif name == "redis_outage_3min":
            fault.target = "redis"
            with self.lock:
                fs.stop("redis", signal.SIGTERM)
                lines = fs.stack.supervise()  # sees the death and plans the restart after its back-off ...
                # ... which is held back for the outage: Redis is down for the whole fault, then the supervisor
                # starts it again as usual.
                fs.stack.restarts["redis"].restart_at = time.monotonic() + fault.plan.duration_s
            self._supervised([*lines, f"(the soak holds Redis down for {fault.plan.duration_s:.0f}s)"])
            self._hold(fault.plan.duration_s)
            fault.note = self._wait_redis(60)
        elif name == "s3_errors":
            fault.target = "s3 proxy"
            for mode in fault.plan.detail.split(","):
                self.proxy.fault = mode  # type: ignore[assignment]
                self._hold(fault.plan.duration_s / 3)
            self.proxy.fault = "none"
            fault.note = f"{self.proxy.injected} requests faulted so far"
        elif name == "s3_unreachable":
            fault.target = "s3 proxy"
            self.proxy.listen(False)
            self._hold(fault.plan.duration_s)
            self.proxy.listen(True)
        elif name == "s3_full":
            fault.target = "s3 proxy"
            self.proxy.fault = "full"
            self._hold(fault.plan.duration_s)
            self.proxy.fault = "none"
            fault.note = f"{self.proxy.injected} requests faulted so far"
        elif name == "inference_sigkill":
            fault.target = "inference"
            with self.lock:
                fs.kill_whole("inference")
        elif name == "inference_hang":
            fault.target = "inference"
            with self.lock:
                pid = fs.process("inference").pid
            os.killpg(pid, signal.SIGSTOP)
            try:
                self._hold(fault.plan.duration_s)
            finally:
                os.killpg(pid, signal.SIGCONT)
        elif name == "producer_sigkill":
            fault.target = "producer"
            with self.lock:
                fs.kill_whole("producer")
        else:
            raise ValueError(f"unknown fault {name}")

    def _wait_redis(self, timeout_s: float) -> str:
        down_at = time.monotonic()
        while time.monotonic() - down_at < timeout_s:
            with contextlib.suppress(redis.RedisError):
                if self.fs.redis.ping():
                    return f"Redis answering again after {time.monotonic() - down_at:.1f}s"
            time.sleep(0.2)
        return f"Redis not answering {timeout_s:.0f}s after the fault ended"

    # ---- jobs -------------------------------------------------------------------------------------------------

    def _drive(self) -> None:
        """Submit and delete as scheduled until the duration is over."""
        next_sample = SAMPLE_EVERY_S
        while (now := _now_s(self.start)) < self.schedule.duration_s:
            self._step(now)
            if now >= next_sample:
                self.samples.append(self._measure(f"+{now:.0f}s"))
                next_sample += SAMPLE_EVERY_S
            time.sleep(1.0)

    def _drain_until_settled(self) -> None:
        """After the duration: the faults are over; wait until every job has ended on its own (and those the soak
        deletes are deleted), up to `drain_s`."""
        deadline = time.monotonic() + self.drain_s
        self.injector_done.wait(timeout=300)
        self.console.print(f"{_utc()} +{_now_s(self.start):6.0f}s faults over; waiting for every job to end")
        next_sample = _now_s(self.start) + SAMPLE_EVERY_S
        while time.monotonic() < deadline:
            now = _now_s(self.start)
            self._step(now)
            if all(job.settled for job in self.jobs):
                return
            if now >= next_sample:
                self.samples.append(self._measure(f"+{now:.0f}s"))
                next_sample += SAMPLE_EVERY_S
            time.sleep(1.0)
        self.errors.append(
            f"not settled {self.drain_s:.0f}s after the soak: "
            + ", ".join(f"{j.plan.job_id} ({j.state})" for j in self.jobs if not j.settled)
        )

    def _step(self, now: float) -> None:
        for job in self.jobs:
            plan = job.plan
            if job.submitted_s is None:
                if now >= plan.at_s and now >= job.next_try_s:
                    self._submit(job, now)
                continue
            if job.deleted_s is None and job.finished_s is None:
                self._poll(job, now)
            delete_due = (plan.delete == "while_running" and now >= job.submitted_s + plan.delete_after_s) or (
                plan.delete == "after_completion" and job.finished_s is not None
            )
            if delete_due and job.deleted_s is None and now >= job.next_delete_s:
                self._delete(job, now)

    def _api(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return self.fs.api.request(method, path, timeout=120, **kwargs)

    def _submit(self, job: JobRun, now: float) -> None:
        job.submit_attempts += 1
        try:
            response = self._api("POST", "/v1/jobs", json={"dataset_url": str(job.dataset), **job.plan.spec()})
        except httpx.HTTPError as exc:
            response, error = None, f"{type(exc).__name__}: {exc}"
        else:
            error = f"{response.status_code}: {response.text[:200]}"
        if response is not None and response.status_code == 409:
            # An earlier attempt went through (its answer was lost to a fault): the job exists.
            with contextlib.suppress(httpx.HTTPError):
                if self._api("GET", f"/v1/jobs/{job.plan.job_id}").status_code == 200:
                    response = httpx.Response(201)
        if response is not None and response.status_code == 201:
            job.submitted_s = now
            self.console.print(
                f"{_utc()} +{now:6.0f}s submitted {job.plan.job_id} ({job.plan.conversations} conversations"
                f"{', to be deleted ' + job.plan.delete.replace('_', ' ') if job.plan.delete != 'no' else ''})"
                f"{f' after {job.submit_attempts} attempts' if job.submit_attempts > 1 else ''}"
            )
            return
        job.submit_errors.append(f"+{now:.0f}s {error}")
        job.next_try_s = now + RETRY_SUBMIT_S
        if response is not None and response.status_code < 500 and response.status_code not in (409, 429):
            self.errors.append(f"{job.plan.job_id}: submit refused: {error}")  # ours to fix, not a fault's

    def _poll(self, job: JobRun, now: float) -> None:
        try:
            p = progress.job_progress(self.fs.redis, job.plan.job_id)
        except (redis.RedisError, JobNotFound):
            return  # Redis down, or the job not registered yet (a producer killed mid-enqueue, a lost Redis)
        if p.samples_done != job.samples_done:
            self.progress_changes.append((now, job.plan.job_id, p.samples_done))
        job.state, job.samples_done, job.samples_total = p.state, p.samples_done, p.samples_total
        job.shards_rerun, job.shards_dead_lettered = p.shards_rerun, p.shards_dead_lettered
        if p.state in FINISHED and job.finished_s is None:
            job.finished_s = now
            self.console.print(
                f"{_utc()} +{now:6.0f}s {job.plan.job_id} {p.state}: {p.samples_done}/{p.samples_total} samples, "
                f"{p.shards_rerun} shard re-runs, {now - (job.submitted_s or 0):.0f}s after its submit"
            )

    def _delete(self, job: JobRun, now: float) -> None:
        job.delete_attempts += 1
        try:
            response = self._api("DELETE", f"/v1/jobs/{job.plan.job_id}", params={"cancel": "true"})
        except httpx.HTTPError as exc:
            job.delete_errors.append(f"+{now:.0f}s {type(exc).__name__}: {exc}")
            job.next_delete_s = now + RETRY_DELETE_S
            return
        if response.status_code == 200 or (response.status_code == 404 and job.delete_attempts > 1):
            # 404 after an attempt whose answer was lost: that attempt deleted it.
            job.deleted_s = now
            report = response.json() if response.status_code == 200 else {}
            self.console.print(
                f"{_utc()} +{now:6.0f}s deleted {job.plan.job_id} (state {job.state}, "
                f"{report.get('objects_deleted', '?')} objects, cancelled {report.get('cancelled', '?')})"
            )
            return
        job.delete_errors.append(f"+{now:.0f}s {response.status_code}: {response.text[:200]}")
        job.next_delete_s = now + RETRY_DELETE_S

    # ---- resources --------------------------------------------------------------------------------------------

    def _measure(self, label: str) -> dict[str, Any]:
        sample: dict[str, Any] = {
            "label": label,
            "t_s": _now_s(self.start),
            "jobs_finished": sum(j.finished_s is not None or j.deleted_s is not None for j in self.jobs),
        }
        try:
            info = self.fs.redis.info("memory")
            sample["redis_used_memory"] = info["used_memory"]
            sample["redis_keys"] = self.fs.redis.dbsize()
        except redis.RedisError:
            sample["redis_used_memory"] = sample["redis_keys"] = None
        fds: dict[str, int] = {}
        rss: dict[str, int] = {}
        counts: dict[str, int] = {}  # processes summed in each figure of `rss`
        with self.lock:
            processes = [*self.fs.stack.processes, ("s3", self.weed.process)]
        for name, popen in processes:
            group = "worker" if name.startswith("worker-") else name
            with contextlib.suppress(psutil.Error, AttributeError):
                root = psutil.Process(popen.pid)  # type: ignore[union-attr]
                for proc in [root, *root.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        fds[group] = fds.get(group, 0) + proc.num_fds()
                        proc_rss = proc.memory_info().rss
                        parts = [group]
                        if group == "worker":  # what a worker keeps in its main process or in its pool's
                            parts.append("worker_main" if proc.pid == root.pid else "worker_pool")
                        for part in parts:
                            rss[part] = rss.get(part, 0) + proc_rss
                            counts[part] = counts.get(part, 0) + 1
        sample["open_fds"] = fds
        sample["open_fds_total"] = sum(fds.values())
        sample["rss"] = rss
        sample["processes"] = counts
        sample["worker_rss"] = rss.get("worker")
        try:
            total, count = 0, 0
            for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.root + "/"):
                for obj in page.get("Contents", []):
                    total += obj["Size"]
                    count += 1
            sample["storage_bytes"], sample["storage_objects"] = total, count
        except Exception:
            sample["storage_bytes"] = sample["storage_objects"] = None
        return sample

    # ---- verification -----------------------------------------------------------------------------------------

    def _verify(self) -> None:
        storage = self.fs.storage
        for job in self.jobs:
            job_id = job.plan.job_id
            try:
                if job.plan.delete != "no":
                    self._verify_deleted(job)
                    continue
                if job.state != "completed":
                    job.checks.append(f"state {job.state}, expected completed")
                    job.checks.extend(self._why_unfinished(job))
                if (job.samples_done, job.shards_dead_lettered) != (job.samples_total, 0):
                    job.checks.append(
                        f"{job.samples_done}/{job.samples_total} samples, {job.shards_dead_lettered} dead-lettered"
                    )
                if job.submitted_s is None:
                    job.checks.append("never submitted")
                    continue
                audit = audit_job if job.plan.kind == "extract" else audit_regenerate_job
                job.audit = audit(storage, job_id)
                if not job.audit.clean:
                    job.checks.append(job.audit.explain())
                if job.plan.kind == "regenerate":
                    for key in (layout.regenerated_dataset(job_id), layout.regeneration_summary(job_id)):
                        if not storage.exists(key):
                            job.checks.append(f"{key} missing: the job was not finalized")
            except Exception as exc:
                job.checks.append(f"verification failed: {type(exc).__name__}: {exc}")
        # Nothing under the soak's root but the jobs' folders and the index entries of the jobs that remain.
        kept = {j.plan.job_id for j in self.jobs if j.plan.delete == "no"}
        stray = [
            key
            for key in storage.list("")
            if key.split("/", 1)[0] not in kept and key.removeprefix(layout.JOB_INDEX_PREFIX) not in kept
        ]
        if stray:
            self.errors.append(f"{len(stray)} object(s) outside the remaining jobs: {stray[:5]}")

    def _why_unfinished(self, job: JobRun) -> list[str]:
        """Evidence for a job that did not end: the shards storage holds as committed (their manifests) against
        those Redis counted, and what the worker logs say of the shards missing from the count."""
        job_id = job.plan.job_id
        try:
            stored = self.fs.committed(job_id)
            counted = progress.committed_shards(self.fs.redis, job_id)
            lines = [f"manifests in storage for shards {sorted(stored)}; Redis counted shards {sorted(counted)}"]
        except Exception as exc:
            return [f"cannot compare storage and Redis: {exc!r}"]
        try:
            total = progress.job_progress(self.fs.redis, job_id).shards_total
            held = {lease.shard_index: lease for lease in leases.held(self.fs.redis) if lease.job_id == job_id}
            unacked = {}  # task id -> ETA of the job's messages that a worker took and never acknowledged
            for raw in self.fs.redis.hvals("unacked"):
                headers = json.loads(raw)[0]["headers"]
                if str(headers.get("id", "")).startswith(f"{job_id}:"):
                    unacked[headers["id"]] = headers.get("eta")
            for shard in sorted(set(range(total)) - stored - counted):
                task = f"{job_id}:{job.plan.kind}:{shard:06d}"
                lease = held.get(shard)
                lines.append(
                    f"shard {shard} neither stored nor counted: lease "
                    + (f"held by {lease.holder} since {lease.acquired_at:.0f}" if lease else "none")
                    + (f"; its message unacknowledged in the broker (ETA {unacked[task]})" if task in unacked else "")
                )
        except Exception as exc:
            lines.append(f"cannot read the job's leases and messages: {exc!r}")
        logs = self.fs.worker_logs().splitlines()
        for shard in sorted(stored - counted):
            task = f"{job_id}:{job.plan.kind}:{shard:06d}"
            said = [line[:200] for line in logs if task in line or f"shard {shard} of job {job_id}" in line]
            lines.append(
                f"shard {shard} committed in storage, never counted; worker logs: "
                + " | ".join(x for x in said if "received" not in x and "succeeded" not in x)[-900:]
            )
        return lines

    def _verify_deleted(self, job: JobRun) -> None:
        job_id = job.plan.job_id
        if job.deleted_s is None:
            job.checks.append(f"not deleted (state {job.state}; delete answers: {job.delete_errors[-3:]})")
            return
        left = self.fs.storage.list(f"{job_id}/")
        if left:
            job.checks.append(f"{len(left)} object(s) left after its delete: {left[:3]}")
        if self.fs.storage.exists(layout.job_index_entry(job_id)):
            job.checks.append("its storage index entry is left")
        keys = sorted(k.decode() for k in self.fs.redis.scan_iter(match=f"*{job_id}*", count=1000))
        if keys:
            # What the workers did with the job's shards after the delete (evidence for the report).
            logs = self.fs.worker_logs()
            resent = logs.count(f"of job {job_id} queued again")
            missing = len(re.findall(rf"job={re.escape(job_id)} shard=\d+: the job does not exist", logs))
            job.checks.append(
                f"{len(keys)} Redis key(s) left after its delete, e.g. {keys[:3]}; worker logs: {resent} shard(s) of "
                f"it queued again by the lease reaper, {missing} run(s) finding the job deleted"
            )
        if self._api("GET", f"/v1/jobs/{job_id}").status_code != 404:
            job.checks.append("GET /v1/jobs/{id} does not answer 404")

    # ---- report -----------------------------------------------------------------------------------------------

    def _report(self, wall_s: float) -> bool:
        failures = [f"{j.plan.job_id}: {c}" for j in self.jobs for c in j.checks] + self.errors
        totals = {"expected": 0, "once": 0, "dup": 0, "lost": 0, "torn": 0, "stray": 0}
        jobs_table = Table(title=f"jobs (seed {self.schedule.seed})")
        for column in ("job", "kind", "submit s", "tries", "end s", "state", "expected", "once", "dup", "lost"):
            jobs_table.add_column(column, justify="left" if column in ("job", "kind", "state") else "right")
        for column in ("torn", "stray", "re-runs", "faults", "result"):
            jobs_table.add_column(column, justify="right")
        for job in self.jobs:
            a = job.audit
            if a is not None:
                for key, value in zip(
                    totals,
                    (a.samples_expected, a.committed_once, a.duplicated, a.lost, len(a.torn), len(a.stray)),
                    strict=True,
                ):
                    totals[key] += value
            end = job.deleted_s if job.plan.delete != "no" else job.finished_s
            state = f"deleted ({job.plan.delete.replace('_', ' ')})" if job.deleted_s is not None else job.state
            cells = [a.samples_expected, a.committed_once, a.duplicated, a.lost, len(a.torn), len(a.stray)] if a else []
            jobs_table.add_row(
                job.plan.job_id,
                job.plan.kind,
                _cell(job.submitted_s),
                str(job.submit_attempts),
                _cell(end),
                str(state),
                *[str(c) for c in cells] or ["-"] * 6,
                str(job.shards_rerun),
                str(len(self._faults_during(job))),
                "[green]ok[/green]" if not job.checks else "[red]FAIL[/red]",
            )
        self.console.print(jobs_table)

        faults_table = Table(title="faults injected")
        for column in ("at s", "fault", "target", "lasted s", "note"):
            faults_table.add_column(column)
        for fault in self.faults:
            if fault.started_s is None:
                continue
            faults_table.add_row(
                _cell(fault.started_s),
                fault.plan.fault,
                fault.target or fault.plan.detail,
                _cell((fault.ended_s or fault.started_s) - fault.started_s),
                (fault.note + (f" [red]{fault.error}[/red]" if fault.error else ""))[:110],
            )
        self.console.print(faults_table)

        start, end = self.samples[0], self.samples[-1]
        resources = Table(
            title="resources (start: stack up, no job; warm: first job ended; end: every job ended; growth a job: "
            "least-squares slope against the jobs ended, over each half of them)"
        )
        for column in ("figure", "start", "warm", "end", "max", "1st half / job", "2nd half / job", "limit / job"):
            resources.add_column(column, justify="left" if column == "figure" else "right")
        resources.add_column("verdict")
        resource_rows = {}
        processes = {part: max(s.get("processes", {}).get(part, 0) for s in self.samples) for part in end["rss"]}
        for figure in resource_figures(sorted(end["open_fds"]), processes):
            readable = [(s, v) for s in self.samples if (v := figure.read(s)) is not None]  # not Redis mid-outage
            # Warm: the first sample once a job had ended in which the figure could be read.
            warm = next((v for s, v in readable if s["jobs_finished"] >= 1), None)
            judgement = judge_figure(figure, self.samples)
            row = {
                "start": figure.read(start),
                "warm": warm,
                "end": figure.read(end),
                "max": max((v for _, v in readable), default=None),
                "first_half_per_job": judgement.first_half_per_job,
                "second_half_per_job": judgement.second_half_per_job,
                "threshold_per_job": figure.threshold_per_job,
                "verdict": judgement.verdict,
            }
            resource_rows[figure.name] = row
            verdict = {"bounded": "[green]bounded[/green]", "growing": "[red]GROWING[/red]"}.get(
                judgement.verdict, judgement.verdict
            )
            resources.add_row(figure.name, *[_cell(v) for v in list(row.values())[:-1]], verdict)
            if judgement.growing:
                failures.append(
                    f"{figure.name} keeps growing: {_cell(judgement.second_half_per_job)} a job over the second half "
                    f"of the jobs (first half {_cell(judgement.first_half_per_job)}), more than "
                    f"{_cell(figure.threshold_per_job)}"
                )
        self.console.print(resources)

        faults_by_type: dict[str, int] = {}
        for fault in self.faults:
            if fault.started_s is not None:
                faults_by_type[fault.plan.fault] = faults_by_type.get(fault.plan.fault, 0) + 1
        outage = self._outage_recovery()
        completed = sum(1 for j in self.jobs if j.plan.delete == "no" and j.state == "completed")
        deleted = sum(1 for j in self.jobs if j.deleted_s is not None)
        passed = not failures
        self.console.print(
            f"seed {self.schedule.seed}, {self.schedule.duration_s / 60:.0f} min soak + drain, wall {wall_s / 60:.1f} "
            f"min: {len(self.jobs)} jobs ({completed} completed, {deleted} deleted), "
            f"{sum(faults_by_type.values())} faults {faults_by_type}; audit totals {totals}"
        )
        for line in outage:
            self.console.print(f"- {line}")
        for line in failures:
            self.console.print(f"[red]FAIL[/red] {line}")
        self.console.print("[bold green]PASSED[/bold green]" if passed else "[bold red]FAILED[/bold red]")
        self.console.print(
            f"replay: python -m tests.soak --minutes {self.schedule.duration_s / 60:g} --seed {self.schedule.seed}"
        )
        self.report_path.parent.mkdir(parents=True, exist_ok=True)
        self.report_path.write_text(
            json.dumps(
                {
                    "seed": self.schedule.seed,
                    "duration_s": self.schedule.duration_s,
                    "wall_s": round(wall_s, 1),
                    "passed": passed,
                    "failures": failures,
                    "audit_totals": totals,
                    "faults_by_type": faults_by_type,
                    "redis_outage": outage,
                    "resources": resource_rows,
                    "jobs": [_job_json(j) | {"faults_during": self._faults_during(j)} for j in self.jobs],
                    "faults": [asdict(f) for f in self.faults],
                    "samples": self.samples,
                    "supervisor": self.supervisor_lines,
                    "settings_changed_from_default": [],
                    "schedule": self.schedule.to_json(),
                    "logs": str(self.run_dir / "logs"),
                },
                indent=1,
                default=str,
            )
        )
        self.console.print(f"written to {self.report_path}")
        return passed

    def _faults_during(self, job: JobRun) -> list[str]:
        """The faults that overlapped the job's life (submit to end; a submit retried through a fault counts)."""
        if job.submitted_s is None:
            return []
        first = job.plan.at_s
        end = job.deleted_s if job.deleted_s is not None else job.finished_s
        last = end if end is not None else float("inf")
        return [
            f.plan.fault
            for f in self.faults
            if f.started_s is not None and f.started_s <= last and (f.ended_s or f.started_s) >= first
        ]

    def _outage_recovery(self) -> list[str]:
        """For each 3-minute Redis outage: how long after Redis was back a job made progress again, and what the
        workers and the supervisor did meanwhile."""
        lines = []
        for fault in self.faults:
            if fault.plan.fault != "redis_outage_3min" or fault.ended_s is None or fault.started_s is None:
                continue
            after = [(t, j) for t, j, _ in self.progress_changes if t >= fault.ended_s]
            running = [
                j.plan.job_id
                for j in self.jobs
                if j.submitted_s is not None
                and j.submitted_s <= fault.started_s
                and (j.finished_s is None or j.finished_s > fault.started_s)
            ]
            restarts = [line for line in fault.supervisor if "exited" in line]
            lines.append(
                f"Redis outage at +{fault.started_s:.0f}s for {fault.ended_s - fault.started_s:.0f}s: jobs running "
                f"then {running}; first progress {after[0][0] - fault.ended_s:.0f}s after Redis was back "
                f"({after[0][1]})"
                if after
                else f"Redis outage at +{fault.started_s:.0f}s: no job made progress after it (running then: {running})"
            )
            lines.append(f"  during it the supervisor saw: {restarts or 'no process exit'}")
        return lines


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) < 1e5 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _job_json(job: JobRun) -> dict[str, Any]:
    data = asdict(job)
    data["dataset"] = str(job.dataset)
    return data


def run_soak(*, minutes: float, seed: int, run_dir: Path, report_path: Path, drain_minutes: float) -> bool:
    schedule = build_schedule(seed, minutes * 60, workers=WORKERS)
    return Soak(schedule, run_dir=run_dir, report_path=report_path, drain_s=drain_minutes * 60).run()
