"""Read-only views an operator needs beside /v1/jobs: the cluster (workers, queue), each job's activity, timeline,
dead letters, storage location and trainer runs. The dashboard is built on these."""

import time
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, status
from fastapi.responses import HTMLResponse
from pydantic import BaseModel

from services.producer.deps import Authorized, JobIdPath, RedisDep, SettingsDep, StorageDep
from shared.errors import JobNotFound
from shared.lifecycle import budget, jobs, progress
from shared.lifecycle.schemas import DeadLetter, JobRecord, Progress
from shared.ops import cluster, inspection, timeline
from shared.storage import layout

router = APIRouter(tags=["operations"])

RunName = Annotated[str, Path(pattern=inspection.RUN_NAME_PATTERN)]


class ClusterStatus(BaseModel):
    server_ts: float  # the API's clock: the dashboard measures freshness against it
    workers: list[cluster.WorkerStatus]
    queue: cluster.QueueDepth
    stall_after_s: float


class Overview(ClusterStatus):
    jobs: list[timeline.JobOverview]


class JobDetails(BaseModel):
    job: JobRecord
    progress: Progress
    activity: timeline.JobActivity
    storage_root: str
    dead_letters: list[DeadLetter]
    trainer_runs: list[inspection.TrainerRun]
    kind_options: dict[str, Any]  # the options of the job's kind, as its spec recorded them (shared/lifecycle/kind.py)


def _cluster(settings: SettingsDep, client: RedisDep) -> ClusterStatus:
    return ClusterStatus(
        server_ts=time.time(),
        workers=cluster.list_workers(client, stale_after_s=3 * settings.worker_heartbeat_interval_s),
        queue=cluster.queue_depth(client),
        stall_after_s=settings.stall_after_s,
    )


@router.get("/v1/cluster")
def get_cluster(settings: SettingsDep, client: RedisDep) -> ClusterStatus:
    """Workers seen in the last day (alive: beat within three heartbeat intervals), what each holds, the queue."""
    return _cluster(settings, client)


@router.get("/v1/overview")
def get_overview(settings: SettingsDep, client: RedisDep) -> Overview:
    """Everything the dashboard's first page shows, read at one moment: every job with its activity, and the cluster."""
    overviews = []
    for job_id in progress.list_jobs(client):
        try:
            overviews.append(
                timeline.job_overview(
                    client,
                    job_id,
                    window_s=settings.progress_window_s,
                    budget_bytes=budget.store_budget(client, settings),
                    stall_after_s=settings.stall_after_s,
                )
            )
        except JobNotFound:
            continue  # deleted between the listing and the read
    return Overview(**_cluster(settings, client).model_dump(), jobs=overviews)


@router.get("/v1/jobs/{job_id}/details", dependencies=[Authorized])
def get_job_details(job_id: JobIdPath, settings: SettingsDep, storage: StorageDep, client: RedisDep) -> JobDetails:
    """A job's settings, progress, activity (stalled or not), storage root, dead letters and trainer runs."""
    job = jobs.load_job(storage, job_id)
    overview = timeline.job_overview(
        client,
        job_id,
        window_s=settings.progress_window_s,
        budget_bytes=budget.store_budget(client, settings),
        stall_after_s=settings.stall_after_s,
    )
    return JobDetails(
        job=job,
        progress=overview.progress,
        activity=overview.activity,
        storage_root=inspection.storage_root(storage, job_id),
        dead_letters=inspection.dead_letters(storage, job_id),
        trainer_runs=inspection.trainer_runs(storage, job_id),
        kind_options=job.spec.model_extra or {},
    )


@router.get("/v1/jobs/{job_id}/timeline")
def get_job_timeline(job_id: JobIdPath, client: RedisDep, points: int = 120) -> timeline.JobTimeline:
    """Committed tokens and shards in `points` equal intervals from the job's creation to now (or its end)."""
    return timeline.job_timeline(client, job_id, points=min(max(points, 2), 1000))


@router.get("/v1/jobs/{job_id}/trainer/{run_name}/curves", response_class=HTMLResponse)
def get_trainer_curves(job_id: JobIdPath, run_name: RunName, storage: StorageDep) -> HTMLResponse:
    """The trainer's loss and accuracy curves (inline SVG, no script), as the trainer last wrote them."""
    try:
        page = storage.get(layout.trainer_curves(job_id, run_name))
    except KeyError as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no curves for run {run_name!r} of job {job_id!r}") from exc
    # Shown in a sandboxed frame; the policy also stops any script should the page ever carry one.
    return HTMLResponse(page, headers={"Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'"})
