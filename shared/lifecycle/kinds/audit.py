"""Audit: a seeded sample of an extraction job's committed hidden states recomputed by an independent backend and
compared tensor by tensor (shared/capture/compare.py), so that states a server setting corrupted, a layer mix-up or a
file changed after its commit are caught before a drafter is trained on them.

- plan: no dataset; the source job's manifests list its committed samples, a seeded random subset of them
  (`audit_samples`, or `audit_fraction` of them) is grouped into shards of about `shard_token_budget` tokens;
- a shard: for each sample, its stored file (size and sha256 against the source manifest), the recomputation of its
  input ids by the backend (`audit_backend_url`, default the workers' own server), the comparison per aux layer and
  of the final state, each slice's nearest layer; each sample's result is written create-only;
- after the last commit: `{source}/audit/report.json`, the verdict the trainer reads (`eagle3 train` warns, or with
  `--require-audit` refuses, when the job's last audit failed).
"""

import logging
import math
import random
import statistics
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import redis
from pydantic import BaseModel, Field, field_validator, model_validator

from shared.access import JOB_ID_PATTERN
from shared.capture.tolerances import DEFAULT_TOLERANCES, FieldTolerances, Tolerances
from shared.errors import JobNotFound, SubmitError
from shared.lifecycle import progress
from shared.lifecycle.command import CommandSession, KindCommand, Positional, ResultTable
from shared.lifecycle.kind import JobKind, JobPlan, KindOptions, KindRecord, ShardContext, Target, check_served_model
from shared.lifecycle.schemas import JobRecord, JobSpec, Manifest, ManifestSample, ShardInput, utc_now
from shared.lifecycle.shards import load_job
from shared.settings import Settings
from shared.storage import layout
from shared.storage.objects import ObjectDigest, ObjectNotFound, Storage
from shared.urls import redact_url

# The registry of kinds, which the command line reads, must not load torch: what loads it (the capture client, the
# comparison, the sample format) is imported where the work needs it.
if TYPE_CHECKING:
    from shared.capture.client import InferenceClient
    from shared.capture.compare import SampleComparison

logger = logging.getLogger(__name__)

DEFAULT_SAMPLES = 32  # without --samples or --fraction: enough to catch a systematic defect, cheap to recompute
REPORT_WAIT_S = 60.0  # `eagle3 audit`: the last shard's worker writes the report just after its commit
AUDIT_FAILED = "samples_audit_failed"


def report_key(source_job_id: str) -> str:
    """The last audit's verdict on a job, next to the job it judges."""
    return f"{source_job_id}/audit/report.json"


def result_key(job_id: str, sample_index: int) -> str:
    return f"{job_id}/audit/results/sample_{sample_index:09d}.json"


class AuditItem(BaseModel):
    """One committed sample of the source job, as its manifest describes it."""

    sample_index: int  # its place in the audit job
    sample_id: str
    source_index: int  # its sample_index in the source job
    source_shard: int
    key: str
    num_tokens: int
    bytes: int
    sha256: str


class AuditShardInput(BaseModel):
    job_id: str
    shard_index: int
    source_job_id: str
    items: list[AuditItem]


class AuditResult(BaseModel):
    """One sample's verdict: its errors (None where not compared) and, when it failed, why."""

    sample_index: int
    sample_id: str
    source_index: int
    source_shard: int
    passed: bool
    aux_errors: list[float | None]
    final_error: float | None
    nearest_aux: list[int | None]
    reasons: list[str]

    @classmethod
    def of(cls, item: AuditItem, comparison: "SampleComparison | None", reasons: list[str]) -> "AuditResult":
        def number(value: float) -> float | None:
            return None if math.isnan(value) else round(value, 6)

        return cls(
            sample_index=item.sample_index,
            sample_id=item.sample_id,
            source_index=item.source_index,
            source_shard=item.source_shard,
            passed=comparison is not None and comparison.passed and not reasons,
            aux_errors=[number(e) for e in comparison.aux_errors] if comparison else [None] * 3,
            final_error=number(comparison.final_error) if comparison else None,
            nearest_aux=comparison.nearest_aux if comparison else [None] * 3,
            reasons=reasons + (comparison.reasons if comparison else []),
        )


class AuditManifest(BaseModel):
    """manifests/shard_{k}.json of an audit job, written create-only and last like every manifest."""

    job_id: str
    shard_index: int
    kind: Literal["audit"] = "audit"
    source_job_id: str
    backend: dict[str, Any]  # what recomputed: url (redacted), backend, version
    results: list[AuditResult]
    num_samples: int
    num_tokens: int
    bytes: int
    counters: dict[str, int]
    # Stamped by the shard lifecycle (shared/lifecycle/shards.py) just before the commit.
    worker: str = ""
    started_at: str = ""
    committed_at: str = ""
    timings_s: dict[str, float] = Field(default_factory=dict)


class LayerErrors(BaseModel):
    name: str  # "aux 0 (layer 1)" or "final"
    median: float | None
    worst: float | None


class AuditReport(BaseModel):
    """{source}/audit/report.json: the last audit of a job."""

    source_job_id: str
    audit_job_id: str
    finished_at: str
    backend: dict[str, Any]  # what recomputed: url (redacted), backend, version
    source_backend: dict[str, Any] = Field(default_factory=dict)  # what extracted (the source's first manifest)
    # a backend of another kind than the one that extracted: a defect of the extracting server itself is caught
    independent: bool | None = None
    storage_dtype: str
    tolerances: FieldTolerances
    aux_layer_ids: list[int]
    samples_checked: int
    samples_failed: int
    passed: bool
    layers: list[LayerErrors]
    failures: list[AuditResult]


class AuditOptions(KindOptions):
    """An audit job's options: which extraction job, how many of its samples, against what, how strictly."""

    source_job_id: str | None = Field(default=None, pattern=JOB_ID_PATTERN, description="the extraction job to audit")
    audit_samples: int | None = Field(default=None, ge=1, description="samples to check (default 32)")
    audit_fraction: float | None = Field(default=None, gt=0, le=1, description="or this share of the job's samples")
    audit_backend_url: str | None = Field(
        default=None,
        description="the capture server that recomputes, an http(s) URL; 'reference' or none: the transformers "
        "reference server (EAGLE3_REFERENCE_URL, else the workers' own server)",
    )
    audit_tolerance_aux: float | None = Field(default=None, gt=0, description="allowed relative error of an aux layer")
    audit_tolerance_final: float | None = Field(default=None, gt=0, description="allowed relative error, final state")
    seed: int | None = Field(default=None, description="which samples (default 0)")

    @field_validator("audit_backend_url")
    @classmethod
    def _backend(cls, value: str | None) -> str | None:
        if value is None or value == REFERENCE_BACKEND:
            return None  # the reference server, resolved by the worker that runs the shard (`backend_url`)
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"{value!r}: '{REFERENCE_BACKEND}' or a capture server's http(s) URL")
        return value

    @model_validator(mode="after")
    def _one_size(self) -> "AuditOptions":
        if self.audit_samples is not None and self.audit_fraction is not None:
            raise ValueError("audit_samples and audit_fraction: give one or the other")
        return self


REFERENCE_BACKEND = "reference"


def backend_url(spec: JobSpec, settings: Settings) -> str:
    """The server that recomputes an audit's samples: the job's URL, else the reference server's, else the workers'."""
    return AuditOptions.of(spec).audit_backend_url or settings.reference_url or settings.inference_url


def tolerances_of(spec: JobSpec) -> Tolerances:
    """The default tolerances, with the job's overrides for the source's storage dtype."""
    options = AuditOptions.of(spec)
    override = {
        name: value
        for name, value in (("aux", options.audit_tolerance_aux), ("final", options.audit_tolerance_final))
        if value is not None
    }
    if not override:
        return DEFAULT_TOLERANCES
    dtype = spec.storage_dtype
    current = DEFAULT_TOLERANCES.for_dtype(dtype)
    return DEFAULT_TOLERANCES.model_copy(update={dtype: current.model_copy(update=override)})


def select_samples(
    manifests: list[Manifest], *, samples: int | None, fraction: float | None, seed: int
) -> list[tuple[int, ManifestSample]]:
    """A seeded random subset of every committed sample, in the source's order (shard, then sample)."""
    committed = [(m.shard_index, s) for m in sorted(manifests, key=lambda m: m.shard_index) for s in m.samples]
    wanted = samples if samples is not None else math.ceil(fraction * len(committed)) if fraction else DEFAULT_SAMPLES
    chosen = sorted(random.Random(f"audit:{seed}").sample(range(len(committed)), min(wanted, len(committed))))
    return [committed[i] for i in chosen]


class Audit(JobKind[AuditShardInput, AuditItem, AuditResult, AuditManifest]):
    name = "audit"
    options = AuditOptions
    record = KindRecord  # JobRecord's common fields are all it records
    finalizes = False  # its last shard's worker writes the report after the commit; the job is complete without it
    input_type = AuditShardInput
    manifest_type = AuditManifest
    reads_dataset: ClassVar[bool] = False
    counters: ClassVar[dict[str, str]] = {AUDIT_FAILED: "Audited samples whose stored states failed the check"}
    command = KindCommand(
        help="re-check a job's committed hidden states: a seeded sample recomputed by an independent backend",
        description="Submits a job of kind audit, follows it, prints the errors per layer and every failed sample, "
        "and exits 1 when the audit failed. The verdict is kept with the job (`eagle3 train` warns on a failed one).",
        positionals=(Positional("source_job_id", metavar="JOB"),),
        common_options=("shard_token_budget", "job_id"),
        flags={
            "audit_samples": ("--samples",),
            "audit_fraction": ("--fraction",),
            "audit_backend_url": ("--backend",),
            "audit_tolerance_aux": ("--tolerance-aux",),
            "audit_tolerance_final": ("--tolerance-final",),
        },
        json_result=True,
    )

    # ---- submit

    def complete_spec(self, spec: JobSpec, storage: Storage) -> JobSpec:
        source_job_id = AuditOptions.of(spec).source_job_id
        if not source_job_id:
            raise SubmitError("source_job_id: an audit names the extraction job it checks")
        try:
            source = load_job(storage, source_job_id)
        except JobNotFound:
            raise SubmitError(f"source_job_id {source_job_id}: no such job in {storage.url}") from None
        if source.kind != "extract":
            raise SubmitError(f"source_job_id {source.job_id}: a job of kind {source.kind!r} has no hidden states")
        # The source's target, layers and stored dtype: the recomputation must be of the same thing.
        return spec.model_copy(
            update={
                "model_path": spec.model_path or source.model.path,
                "aux_layer_ids": source.aux_layer_ids,
                "storage_dtype": source.spec.storage_dtype,
                "max_length": source.spec.max_length,
            }
        )

    def select(self, spec: JobSpec, storage: Storage) -> list[AuditItem]:
        options = AuditOptions.of(spec)
        assert options.source_job_id is not None  # complete_spec refused the spec without it
        manifests = [
            Manifest.model_validate_json(storage.get(key))
            for key in storage.list(layout.manifests_prefix(options.source_job_id))
        ]
        chosen = select_samples(
            manifests, samples=options.audit_samples, fraction=options.audit_fraction, seed=options.seed or 0
        )
        if not chosen:
            raise SubmitError(f"source_job_id {options.source_job_id}: no committed sample to audit yet")
        return [
            AuditItem(
                sample_index=index,
                sample_id=sample.sample_id,
                source_index=sample.sample_index,
                source_shard=shard_index,
                key=sample.key,
                num_tokens=sample.num_tokens,
                bytes=sample.bytes,
                sha256=sample.sha256,
            )
            for index, (shard_index, sample) in enumerate(chosen)
        ]

    def plan(self, job_id: str, spec: JobSpec, target: Target, accepted: list[AuditItem]) -> JobPlan[AuditShardInput]:
        source_job_id = AuditOptions.of(spec).source_job_id
        assert source_job_id is not None
        groups: list[list[AuditItem]] = [[]]
        tokens = 0
        for item in accepted:
            if groups[-1] and tokens + item.num_tokens > spec.shard_token_budget:
                groups.append([])
                tokens = 0
            groups[-1].append(item)
            tokens += item.num_tokens
        shards = [
            AuditShardInput(job_id=job_id, shard_index=index, source_job_id=source_job_id, items=items)
            for index, items in enumerate(groups)
        ]
        return JobPlan(
            shards=shards,
            samples_total=len(accepted),
            tokens_total=sum(item.num_tokens for item in accepted),
            bytes_per_token=0,
            projected_bytes=1024 * len(accepted),  # one small JSON result per sample
            record={"samples_truncated": 0, "loss_tokens_total": 0, "draft_vocab_size": 0, "vocab_coverage": 0.0},
        )

    # ---- one shard

    def open(self, settings: Settings) -> dict[str, "InferenceClient"]:
        return {}  # one client per backend URL, made when a job first needs it

    def prepare(self, ctx: ShardContext, state: dict[str, "InferenceClient"], job: JobRecord) -> "InferenceClient":
        from shared.capture.client import InferenceClient

        url = backend_url(job.spec, ctx.settings)
        if url not in state:
            state[url] = InferenceClient.from_settings(ctx.settings, url)
        client = state[url]
        client.wait_ready(ctx.settings.inference_ready_timeout_s)
        check_served_model(job, client.model_info(), client.base_url, capture=True)
        return client

    def items(self, shard: AuditShardInput) -> list[AuditItem]:
        return shard.items

    def item_key(self, job_id: str, item: AuditItem) -> str:
        return result_key(job_id, item.sample_index)

    def reuse(self, item: AuditItem, key: str, data: bytes) -> AuditResult:
        return AuditResult.model_validate_json(data)

    def process(
        self,
        ctx: ShardContext,
        state: dict[str, "InferenceClient"],
        prepared: "InferenceClient",
        job: JobRecord,
        shard: AuditShardInput,
        pending: list[AuditItem],
        done: dict[int, AuditResult],
    ) -> AuditManifest:
        from shared.capture.compare import compare_sample

        storage, tolerances = ctx.storage, tolerances_of(job.spec)
        # The ids the source job planned, not the ones in the file: a whole file from another sample or job is
        # self-consistent, and only its ids (or its length) give it away.
        planned = planned_input_ids(storage, shard.source_job_id, {item.source_shard for item in pending})
        stored: dict[int, dict[str, Any]] = {}
        results = dict(done)
        for item in pending:
            record, reasons = read_stored(storage, item)
            if record is None:
                results[item.sample_index] = AuditResult.of(item, None, reasons)
            else:
                stored[item.sample_index] = record
        items = {item.sample_index: item for item in pending}
        order = list(stored)
        requests = [(f"{job.job_id}-{index}", planned[items[index].source_index]) for index in order]
        recomputed = prepared.capture_many(requests, job.aux_layer_ids)
        for index, (_, ids), states in zip(order, requests, recomputed, strict=True):
            comparison = compare_sample(
                stored[index],
                states,
                job.aux_layer_ids,
                job.spec.storage_dtype,
                recomputed_input_ids=ids,
                tolerances=tolerances,
            )
            results[index] = AuditResult.of(items[index], comparison, [])
        for item in pending:
            result = results[item.sample_index]
            storage.put_if_absent(result_key(job.job_id, item.sample_index), result.model_dump_json().encode())
            if not result.passed:
                logger.warning("audit %s: sample %s failed: %s", job.job_id, item.sample_id, "; ".join(result.reasons))
        ordered = [results[item.sample_index] for item in shard.items]
        info = prepared.model_info()
        return AuditManifest(
            job_id=job.job_id,
            shard_index=shard.shard_index,
            source_job_id=shard.source_job_id,
            backend={"url": redact_url(prepared.base_url), "backend": info.backend, "version": info.version},
            results=ordered,
            num_samples=len(ordered),
            num_tokens=sum(item.num_tokens for item in shard.items),
            bytes=0,
            counters={AUDIT_FAILED: sum(not r.passed for r in ordered)},
        )

    def after_commit(self, ctx: ShardContext, state: Any, job: JobRecord) -> None:
        if len(progress.committed_shards(ctx.redis, job.job_id)) == job.shards_total:
            write_report(ctx.storage, job)

    def after_resume(self, storage: Storage, client: redis.Redis, job: JobRecord, pending: list[int]) -> list[int]:
        report = self.last_report(storage, AuditOptions.of(job.spec).source_job_id or "")
        if not pending and (report is None or report.audit_job_id != job.job_id):
            # every shard committed, this audit's report not written (none, or an earlier audit's): the last shard's
            # task writes it
            return [job.shards_total - 1]
        return []

    def shard_size(self, shard: AuditShardInput) -> tuple[int, int]:
        return len(shard.items), sum(item.num_tokens for item in shard.items)

    # ---- the command

    def follow(self, record: Mapping[str, Any], session: CommandSession) -> None:
        """Always followed to its end: the report (a table, or JSON), and a failed audit fails the command."""
        source_job_id = record["spec"]["source_job_id"]
        backend = record["spec"].get("audit_backend_url") or "the reference server"
        session.say(
            f"submitted audit [bold]{record['job_id']}[/] of {source_job_id}: {record['samples_total']} samples "
            f"recomputed by {backend}"
        )
        p = session.watch(record["job_id"])
        if p.state != "completed":
            session.fail(f"audit {p.job_id} ended {p.state}")
        report = reported(session, source_job_id, record["job_id"])
        session.result(report, report_table(AuditReport.model_validate(report)))
        if not report["passed"]:
            session.fail(f"audit of {source_job_id} failed: {report['samples_failed']} samples")

    # ---- the verdict

    def last_report(self, storage: Storage, job_id: str) -> AuditReport | None:
        """The last audit of job `job_id`, None if it was never audited."""
        try:
            return AuditReport.model_validate_json(storage.get(report_key(job_id)))
        except ObjectNotFound:
            return None

    def last_verdict(self, storage: Storage, job_id: str) -> "AuditVerdict | None":
        """The last audit of job `job_id` in brief, None if it was never audited."""
        report = self.last_report(storage, job_id)
        return None if report is None else AuditVerdict.of(report)


class AuditVerdict(BaseModel):
    """A job's last audit in brief, as its record shows it (GET /v1/jobs/{id}); the whole report is .../audit."""

    audit_job_id: str
    finished_at: str
    passed: bool
    samples_checked: int
    samples_failed: int
    independent: bool | None  # recomputed by a backend of another kind than the one that extracted

    @classmethod
    def of(cls, report: AuditReport) -> "AuditVerdict":
        return cls.model_validate(report.model_dump(include=set(cls.model_fields)))


def planned_input_ids(storage: Storage, source_job_id: str, shard_indices: set[int]) -> dict[int, list[int]]:
    """sample_index -> the input ids the source job planned, for the samples of these shards."""
    planned: dict[int, list[int]] = {}
    for shard_index in shard_indices:
        shard = ShardInput.model_validate_json(storage.get(layout.shard_input(source_job_id, shard_index)))
        planned |= {sample.sample_index: sample.input_ids for sample in shard.samples}
    return planned


def read_stored(storage: Storage, item: AuditItem) -> tuple[dict[str, Any] | None, list[str]]:
    """The stored sample decoded, or None and why it could not be compared."""
    try:
        data = storage.get(item.key)
    except ObjectNotFound:
        return None, [f"stored sample {item.key}: missing"]
    digest = ObjectDigest.of(data)
    if digest.sha256 != item.sha256 or len(data) != item.bytes:
        return None, [
            f"stored sample {item.key}: {len(data)} bytes sha256 {digest.sha256[:12]}, the source manifest says "
            f"{item.bytes} bytes sha256 {item.sha256[:12]} (changed after its commit)"
        ]
    from shared.storage.sample_format import decode_sample

    try:
        return decode_sample(data), []
    except Exception as exc:  # a torn or foreign file: what it is, not why the decoder choked
        return None, [f"stored sample {item.key}: not a sample file ({type(exc).__name__}: {exc})"]


def extracting_backend(storage: Storage, job_id: str) -> dict[str, Any]:
    """The server that extracted job `job_id` (backend and version, as its first committed manifest names it)."""
    for key in storage.list(layout.manifests_prefix(job_id)):
        server = Manifest.model_validate_json(storage.get(key)).server
        return {"backend": server["backend"], "version": server.get("version")} if server else {}
    return {}  # no manifest, or one written before manifests named their server


def write_report(storage: Storage, job: JobRecord) -> AuditReport:
    """Every committed shard's results, summed up into the source job's audit report (the last audit wins)."""
    source_job_id = AuditOptions.of(job.spec).source_job_id
    assert source_job_id is not None
    manifests = [
        AuditManifest.model_validate_json(storage.get(key)) for key in storage.list(layout.manifests_prefix(job.job_id))
    ]
    results = [r for m in sorted(manifests, key=lambda m: m.shard_index) for r in m.results]
    limits = tolerances_of(job.spec).for_dtype(job.spec.storage_dtype)
    names = [f"aux {i} (layer {layer})" for i, layer in enumerate(job.aux_layer_ids)] + ["final"]
    columns = [[r.aux_errors[i] for r in results] for i in range(3)] + [[r.final_error for r in results]]
    layers = []
    for name, column in zip(names, columns, strict=True):
        values = [v for v in column if v is not None]
        layers.append(
            LayerErrors(
                name=name,
                median=statistics.median(values) if values else None,
                worst=max(values) if values else None,
            )
        )
    failures = [r for r in results if not r.passed]
    backend = manifests[0].backend if manifests else {}
    source_backend = extracting_backend(storage, source_job_id)
    report = AuditReport(
        source_job_id=source_job_id,
        audit_job_id=job.job_id,
        finished_at=utc_now(),
        backend=backend,
        source_backend=source_backend,
        independent=(backend["backend"] != source_backend["backend"]) if backend and source_backend else None,
        storage_dtype=job.spec.storage_dtype,
        tolerances=limits,
        aux_layer_ids=job.aux_layer_ids,
        samples_checked=len(results),
        samples_failed=len(failures),
        passed=bool(results) and not failures,
        layers=layers,
        failures=failures,
    )
    storage.put(report_key(source_job_id), report.model_dump_json(indent=2).encode())
    logger.info("audit %s of job %s: %d samples, %d failed", job.job_id, source_job_id, len(results), len(failures))
    return report


def reported(session: CommandSession, source_job_id: str, audit_job_id: str) -> dict[str, Any]:
    """The source job's report (GET /v1/jobs/{id}/audit), once this audit has written it."""
    deadline = time.monotonic() + REPORT_WAIT_S
    while True:
        report = session.get(f"/v1/jobs/{source_job_id}/audit")
        if report is not None and report["audit_job_id"] == audit_job_id:
            return dict(report)
        if time.monotonic() > deadline:
            session.fail(f"audit {audit_job_id} completed but wrote no report within {REPORT_WAIT_S:.0f} s")
        time.sleep(1)


def report_table(report: AuditReport) -> ResultTable:
    """The errors per layer, then every failed sample with its reasons."""
    verdict = "[green]passed[/]" if report.passed else "[red]FAILED[/]"
    limits = report.tolerances
    return ResultTable(
        title=f"audit {report.audit_job_id} of {report.source_job_id}: {verdict}, "
        f"{report.samples_checked} samples checked, {report.samples_failed} failed",
        caption=f"relative error per token (RMS); tolerances ({report.storage_dtype}): aux {limits.aux}, "
        f"final {limits.final}; recomputed by {report.backend.get('backend')} at {report.backend.get('url')}"
        + independence(report),
        columns=("layer", "median", "worst"),
        numeric=("median", "worst"),
        rows=[
            (layer.name, *(f"{value:.4f}" if value is not None else "-" for value in (layer.median, layer.worst)))
            for layer in report.layers
        ]
        + [(f"[red]{failure.sample_id}[/]", "", "; ".join(failure.reasons)) for failure in report.failures],
    )


def independence(report: AuditReport) -> str:
    """What the audit's backend says about the extracting one: a check by the same kind of server is no check of it."""
    source = report.source_backend
    if report.independent is False:
        return (
            f"\n[yellow]the same kind of server ({source.get('backend')}) extracted these states: a defect of that "
            "server itself is not caught (--backend reference, with EAGLE3_REFERENCE_URL set, recomputes with the "
            "transformers reference server)[/]"
        )
    return f"; extracted by {source['backend']} {source.get('version', '')}" if source else ""
