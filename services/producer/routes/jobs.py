"""/v1/jobs: submit (extract, regenerate or audit), list, inspect, cancel, resume. Domain errors become HTTP answers in
services/producer/errors.py."""

import json
from typing import Annotated, Any

from fastapi import APIRouter, BackgroundTasks, File, Form, HTTPException, UploadFile, status
from pydantic import BaseModel, Field, ValidationError

from services.producer.deps import (
    Authorized,
    EnqueueDep,
    JobIdPath,
    RedisDep,
    SettingsDep,
    StorageDep,
)
from shared import access
from shared.errors import JobExists, JobNotFound
from shared.lifecycle import budget, deletion, jobs, progress
from shared.lifecycle.kinds import AUDIT, AuditVerdict, kind_of
from shared.lifecycle.schemas import FailedConversation, JobRecord, JobSpec, Progress, RejectedSample
from shared.storage import layout

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


class JobPublic(BaseModel):
    job: JobRecord
    progress: Progress
    audit: AuditVerdict | None = None  # the job's last audit (`eagle3 audit`), if it had one


def _submit(
    spec: JobSpec, settings: SettingsDep, storage: StorageDep, client: RedisDep, enqueue: EnqueueDep
) -> JobPublic:
    job = jobs.submit(spec, settings=settings, storage=storage, client=client, enqueue=enqueue)
    return JobPublic(job=job, progress=_progress(job.job_id, settings, client))


def _progress(job_id: str, settings: SettingsDep, client: RedisDep) -> Progress:
    return progress.job_progress(
        client, job_id, window_s=settings.progress_window_s, budget_bytes=budget.store_budget(client, settings)
    )


def _age_s(older_than: str) -> float:
    try:
        return deletion.parse_age(older_than)
    except ValueError as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, f"older_than: {exc}") from exc


class BudgetUpdate(BaseModel):
    storage_budget_bytes: int | None = Field(ge=1, description="the new budget in bytes; null: unlimited")
    job_id: str | None = Field(
        default=None, pattern=access.JOB_ID_PATTERN, description="a job's own budget; none: the store-wide one"
    )


class BudgetStatus(BaseModel):
    storage_budget_bytes: int | None  # the store-wide budget in force (set while running, else the setting)
    stored_bytes: int  # every job's measured bytes


@router.post("", status_code=status.HTTP_201_CREATED, dependencies=[Authorized])
def create_job(
    spec: JobSpec,
    settings: SettingsDep,
    storage: StorageDep,
    client: RedisDep,
    enqueue: EnqueueDep,
) -> JobPublic:
    """Plan a job from a dataset already in storage or on a path the producer can read. `kind: "regenerate"`
    rewrites the assistant turns with the target (docs/regeneration.md); otherwise hidden states are extracted."""
    return _submit(spec, settings, storage, client, enqueue)


@router.post("/upload", status_code=status.HTTP_201_CREATED, dependencies=[Authorized])
def create_job_from_upload(
    dataset: Annotated[UploadFile, File(description="JSONL dataset")],
    spec: Annotated[str, Form(description="JobSpec as JSON, without dataset_url")],
    settings: SettingsDep,
    storage: StorageDep,
    client: RedisDep,
    enqueue: EnqueueDep,
) -> JobPublic:
    """Upload a dataset with the job; it is kept in storage as `{job_id}/dataset.jsonl`."""
    try:
        fields = json.loads(spec)
        job_id = fields.get("job_id") or jobs.new_job_id()
        key = f"{job_id}/dataset.jsonl"
        fields.update(job_id=job_id, dataset_url=f"{storage.url.rstrip('/')}/{key}")
        parsed = JobSpec.model_validate(fields)
    except (json.JSONDecodeError, ValidationError, AttributeError) as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, f"spec: {exc}") from exc
    assert parsed.job_id is not None  # set above, from the spec or new
    if storage.exists(layout.job_json(parsed.job_id)):  # never replace the dataset of an existing job
        raise JobExists(f"job {parsed.job_id} already exists")
    storage.put(key, dataset.file.read())
    return _submit(parsed, settings, storage, client, enqueue)


@router.get("")
def list_jobs(settings: SettingsDep, client: RedisDep, older_than: str | None = None) -> list[Progress]:
    """Every job's progress, newest first; `older_than=7d`: only finished jobs that finished longer ago, oldest
    first (what `eagle3 delete --older-than` and the retention delete)."""
    if older_than is not None:
        expired = deletion.expired_jobs(client, _age_s(older_than))
        return [_progress(p.job_id, settings, client) for p in expired]  # with the budget, like every listing
    return [_progress(job_id, settings, client) for job_id in progress.list_jobs(client)]


@router.delete("/{job_id}", dependencies=[Authorized])
def delete_job(
    job_id: JobIdPath,
    settings: SettingsDep,
    storage: StorageDep,
    client: RedisDep,
    after: BackgroundTasks,
    cancel: bool = False,
    force: bool = False,
    with_checkpoints: bool = False,
) -> deletion.DeleteReport:
    """Delete a job's objects, Redis keys and index entry; trainer checkpoints stay unless `with_checkpoints`. 409
    when it runs (`cancel` cancels it first) or a running trainer follows it (`force`). An interrupted delete leaves
    the job `deleting`; calling this again finishes it. Once answered, the store is measured again for the budget
    (its files besides the samples went with the job), so a job paused by the budget goes on without waiting for
    the next upkeep."""
    report = deletion.delete_job(
        job_id,
        storage=storage,
        client=client,
        cancel=cancel,
        force=force,
        with_checkpoints=with_checkpoints,
        wait_s=deletion.stop_wait_s(settings),
    )
    after.add_task(budget.remeasure, client, storage)
    return report


@router.get("/{job_id}", dependencies=[Authorized])
def get_job(job_id: JobIdPath, settings: SettingsDep, storage: StorageDep, client: RedisDep) -> JobPublic:
    job = jobs.load_job(storage, job_id)
    return JobPublic(job=job, progress=_progress(job_id, settings, client), audit=AUDIT.last_verdict(storage, job_id))


@router.get("/{job_id}/progress")
def get_progress(job_id: JobIdPath, settings: SettingsDep, client: RedisDep) -> Progress:
    """Token-weighted progress alone (from Redis): what a live progress bar polls. Open, like the job list."""
    return _progress(job_id, settings, client)


@router.get("/{job_id}/rejected", dependencies=[Authorized])
def get_rejected(job_id: JobIdPath, storage: StorageDep) -> list[RejectedSample]:
    try:
        data = storage.get(layout.rejected(job_id))
    except KeyError as exc:
        raise JobNotFound(job_id) from exc
    return [RejectedSample.model_validate_json(line) for line in data.splitlines() if line.strip()]


@router.get("/{job_id}/failed", dependencies=[Authorized])
def get_failed(job_id: JobIdPath, storage: StorageDep) -> list[FailedConversation]:
    """The samples (a regenerate job: conversations) that will not be in the job's output, each with its reason."""
    return kind_of(jobs.load_job(storage, job_id).kind).failed(storage, job_id)


@router.get("/{job_id}/audit", dependencies=[Authorized])
def get_audit(job_id: JobIdPath, storage: StorageDep) -> dict[str, Any]:
    """The job's last audit (`eagle3 audit`): its verdict, errors per layer and failed samples; 404 if never audited."""
    jobs.load_job(storage, job_id)  # an unknown job is a 404 of its own
    report = AUDIT.last_report(storage, job_id)
    if report is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"job {job_id} has not been audited")
    return report.model_dump()


@router.post("/{job_id}/cancel", dependencies=[Authorized])
def cancel_job(job_id: JobIdPath, settings: SettingsDep, storage: StorageDep, client: RedisDep) -> Progress:
    """Queued shards are skipped; shards already running finish and stay committed."""
    jobs.cancel(job_id, storage=storage, client=client)
    return _progress(job_id, settings, client)


@router.post("/{job_id}/resume", dependencies=[Authorized])
def resume_job(
    job_id: JobIdPath,
    settings: SettingsDep,
    storage: StorageDep,
    client: RedisDep,
    enqueue: EnqueueDep,
) -> Progress:
    """Re-enqueue every shard without a manifest, after recounting progress from storage."""
    jobs.resume(job_id, storage=storage, client=client, enqueue=enqueue)
    return _progress(job_id, settings, client)


budget_router = APIRouter(prefix="/v1/budget", tags=["jobs"])


@budget_router.get("")
def get_budget(settings: SettingsDep, client: RedisDep) -> BudgetStatus:
    """The store-wide storage budget in force and what is stored (open, like the job list)."""
    return BudgetStatus(
        storage_budget_bytes=budget.store_budget(client, settings), stored_bytes=budget.stored_bytes(client)
    )


@budget_router.put("", dependencies=[Authorized])
def put_budget(update: BudgetUpdate, settings: SettingsDep, client: RedisDep) -> BudgetStatus:
    """Change the store-wide budget, or a job's own, while jobs run: a job paused by it goes on by itself within
    EAGLE3_STORAGE_WAIT_S once its next shard fits."""
    if update.job_id is None:
        budget.set_store_budget(client, update.storage_budget_bytes)
    else:
        budget.set_job_budget(client, update.job_id, update.storage_budget_bytes)
    return get_budget(settings, client)
