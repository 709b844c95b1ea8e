"""`eagle3` job commands, all through the producer API: submit, regenerate, status (with a live progress bar), jobs,
cancel, resume; and `up`, the stack as local processes."""

import argparse
import json
import logging
import signal
import time
import types
import typing
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
from pydantic.fields import FieldInfo
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from eagle3.api import api_client, check, list_progress, read_progress
from eagle3.local_stack import LocalStack
from eagle3.retention import human_size
from shared import access
from shared.errors import Eagle3Error
from shared.lifecycle.schemas import JobSpec
from shared.lifecycle.schemas import Progress as JobProgress
from shared.settings import Settings

console = Console()
logger = logging.getLogger(__name__)


def _gb(n: float | None) -> str:
    return "–" if n is None else f"{n / 1e9:.3f} GB"


def progress_table(p: JobProgress) -> Table:
    table = Table(title=f"job {p.job_id}: {p.state}", show_header=False)
    eta = "–" if p.eta_seconds is None else f"{p.eta_seconds:.0f} s"
    rows = [
        (
            "samples",
            f"{p.samples_done} / {p.samples_total} committed, {p.samples_rejected} rejected, {p.samples_failed} failed",
        ),
        ("tokens", f"{p.tokens_done} / {p.tokens_total} ({p.tokens_failed} failed)"),
        (
            "shards",
            f"{p.shards_committed} / {p.shards_total} committed, {p.shards_dead_lettered} dead-lettered, "
            f"{p.shards_rerun} re-run",
        ),
        ("rate", f"{p.tokens_per_second:.0f} tokens/s, ETA {eta}, elapsed {p.elapsed_seconds:.0f} s"),
        (
            "storage",
            f"{_gb(p.bytes_stored)} stored, {p.bytes_per_token:.0f} bytes/token, "
            f"{_gb(p.projected_total_bytes)} projected",
        ),
        (
            "budget",
            "unlimited"
            if p.storage_budget_bytes is None
            else f"{_gb(p.storage_budget_bytes)}, headroom {_gb(p.budget_headroom_bytes)}",
        ),
    ]
    if p.regeneration is not None:
        r = p.regeneration
        assert r.output_key is not None  # every regenerate job registers its output key (progress.register_job)
        tokens = f"{p.tokens_done} / {p.tokens_total} projected (at most {r.max_generated_tokens})"
        rows[1] = ("generated tokens", tokens)
        rows[4:] = [
            (
                "conversations",
                f"{r.turns_done} turns regenerated; {r.conversations_with_reasoning} with reasoning, "
                f"{r.conversations_truncated} truncated at max_new_tokens, {r.conversations_empty} empty, "
                f"{r.conversations_failed} failed",
            ),
            ("output", r.output_key + ("" if r.finalized else " (when every shard is committed)")),
        ]
        if r.chained_job_id is not None:
            rows.append(("chained job", r.chained_job_id))
        if r.error is not None:
            rows.append(("error", r.error))
    if p.paused_reason is not None:
        rows.insert(0, ("paused", p.paused_reason))
    for name, value in rows:
        table.add_row(name, value)
    return table


def watch(
    job_id: str,
    api: httpx.Client,
    *,
    interval_s: float = 0.5,
    alive: LocalStack | None = None,
    out: Console = console,
) -> JobProgress:
    """A live token-weighted progress bar (on `out`) until the job finishes."""

    def read() -> JobProgress:
        return read_progress(api, job_id)

    p = read()
    columns = [
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        TextColumn("{task.completed:.0f}/{task.total:.0f} tokens"),
        TextColumn("{task.fields[rate]}"),
        TextColumn("ETA {task.fields[eta]}"),
        TimeElapsedColumn(),
    ]
    with Progress(*columns, console=out, transient=False) as bar:
        task = bar.add_task(job_id, total=p.tokens_total, rate="", eta="–")
        while True:
            p = read()
            eta = "–" if p.eta_seconds is None else f"{p.eta_seconds:.0f}s"
            bar.update(
                task,
                total=p.tokens_total,  # a regenerate job's total is a projection that settles as it runs
                completed=p.tokens_done + p.tokens_failed,
                rate=f"{p.tokens_per_second:.0f} tok/s",
                eta=eta,
                description=f"{job_id} [{p.state}] shards {p.shards_committed}/{p.shards_total}",
            )
            if p.finished:
                break
            if alive is not None:
                alive.check_alive()
            time.sleep(interval_s)
    return p


# The job commands' options are JobSpec's fields (type, choices and help from the schema), so they cannot drift.
EXTRACTION_OPTIONS = (
    "model_path",
    "job_id",
    "max_length",
    "length_policy",
    "draft_vocab_size",
    "shard_token_budget",
    "shard_seconds",
    "storage_dtype",
)
# A kind's own options are its declaration (KindOptions, shared/lifecycle/kinds/): its command offers them all, by the
# flags the declaration names (CLI_FLAGS), but the ones it takes another way (CLI_ELSEWHERE).
AUDIT_COMMON_OPTIONS = ("shard_token_budget", "job_id")
FLAGS: dict[str, tuple[str, ...]] = {"model_path": ("--model", "--model-path")}
AUDIT_REPORT_WAIT_S = 60.0  # the last shard's worker writes the report just after its commit


def add_spec_options(
    parser: argparse.ArgumentParser,
    names: tuple[str, ...],
    fields: dict[str, FieldInfo] = JobSpec.model_fields,
    flags: dict[str, tuple[str, ...]] = FLAGS,
) -> None:
    for name in names:
        field = fields[name]
        kind = field.annotation
        if typing.get_origin(kind) in (typing.Union, types.UnionType):  # X | None: the option is X
            (kind,) = [t for t in typing.get_args(kind) if t is not type(None)]
        options: dict[str, Any] = {"dest": name, "default": None}
        if kind is bool:
            options["action"] = "store_true"
        elif typing.get_origin(kind) is typing.Literal:
            options["choices"] = typing.get_args(kind)
        else:
            options["type"] = kind
        default = "" if field.default in (None, False) else f" (default {field.default})"
        options["help"] = (field.description or "") + default
        parser.add_argument(*flags.get(name, ("--" + name.replace("_", "-"),)), **options)


def kind_options(kind: str) -> dict[str, FieldInfo]:
    """The options a kind declares that its command offers as flags. Imported when asked: the kinds load torch,
    which the job commands (they only talk to the API) do not need to start."""
    from shared.lifecycle.kinds import KINDS

    options = KINDS[kind].options
    return {name: field for name, field in options.model_fields.items() if name not in options.CLI_ELSEWHERE}


def add_kind_options(parser: argparse.ArgumentParser, kind: str) -> None:
    from shared.lifecycle.kinds import KINDS

    fields = kind_options(kind)
    add_spec_options(parser, tuple(fields), fields, FLAGS | KINDS[kind].options.CLI_FLAGS)


def spec_of(args: argparse.Namespace, names: tuple[str, ...], **fields: Any) -> dict[str, Any]:
    given = {name: getattr(args, name) for name in names if getattr(args, name) not in (None, False)}
    return fields | given


def cmd_submit(args: argparse.Namespace, settings: Settings) -> None:
    spec = spec_of(args, EXTRACTION_OPTIONS)
    with api_client(settings) as api:
        job = post_job(api, args.dataset, spec, upload=args.upload)
        job_id = job["job"]["job_id"]
        console.print(
            f"submitted [bold]{job_id}[/]: {job['job']['samples_total']} samples "
            f"({job['job']['samples_rejected']} rejected), {job['job']['tokens_total']} tokens, "
            f"{job['job']['shards_total']} shards"
        )
        if args.watch:
            console.print(progress_table(watch(job_id, api)))


def post_job(api: httpx.Client, dataset: str, spec: dict, *, upload: bool) -> dict:
    """Submit a job of any kind: the dataset uploaded, or its path or URL passed for the producer to read."""
    if upload:
        with open(dataset, "rb") as f:
            return check(api.post("/v1/jobs/upload", files={"dataset": f}, data={"spec": json.dumps(spec)}))
    url = dataset if "://" in dataset else str(Path(dataset).resolve())
    return check(api.post("/v1/jobs", json={**spec, "dataset_url": url}))


def cmd_regenerate(args: argparse.Namespace, settings: Settings) -> None:
    spec = spec_of(args, EXTRACTION_OPTIONS + tuple(kind_options("regenerate")), kind="regenerate")
    if args.out is not None:
        spec["output_url"] = args.out if "://" in args.out else str(Path(args.out).resolve())
    with api_client(settings) as api:
        job = post_job(api, args.dataset, spec, upload=args.upload)
        watch_regeneration(job["job"], api, watch_it=args.watch)


def cmd_audit(args: argparse.Namespace, settings: Settings) -> None:
    names = AUDIT_COMMON_OPTIONS + tuple(kind_options("audit"))
    spec = spec_of(args, names, kind="audit", source_job_id=args.source_job_id)
    out = Console(stderr=True) if args.json else console  # --json: stdout holds the report alone
    with api_client(settings) as api:
        record = check(api.post("/v1/jobs", json=spec))["job"]
        backend = record["spec"].get("audit_backend_url") or "the reference server"
        out.print(
            f"submitted audit [bold]{record['job_id']}[/] of {args.source_job_id}: {record['samples_total']} samples "
            f"recomputed by {backend}"
        )
        p = watch(record["job_id"], api, out=out)
        if p.state != "completed":
            raise SystemExit(f"audit {p.job_id} ended {p.state}")
        report = audit_report(api, args.source_job_id, record["job_id"])
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        console.print(audit_table(report))
    if not report["passed"]:
        raise SystemExit(f"audit of {args.source_job_id} failed: {report['samples_failed']} samples")


def audit_report(api: httpx.Client, source_job_id: str, audit_job_id: str) -> dict:
    """The source job's report, once this audit has written it."""
    deadline = time.monotonic() + AUDIT_REPORT_WAIT_S
    while True:
        response = api.get(f"/v1/jobs/{source_job_id}/audit")
        if response.status_code != 404:
            report = check(response)
            if report["audit_job_id"] == audit_job_id:
                return report
        if time.monotonic() > deadline:
            raise SystemExit(f"audit {audit_job_id} completed but wrote no report within {AUDIT_REPORT_WAIT_S:.0f} s")
        time.sleep(1)


def audit_table(report: dict) -> Table:
    verdict = "[green]passed[/]" if report["passed"] else "[red]FAILED[/]"
    limits = report["tolerances"]
    table = Table(
        title=f"audit {report['audit_job_id']} of {report['source_job_id']}: {verdict}, "
        f"{report['samples_checked']} samples checked, {report['samples_failed']} failed",
        caption=f"relative error per token (RMS); tolerances ({report['storage_dtype']}): aux {limits['aux']}, "
        f"final {limits['final']}; recomputed by {report['backend'].get('backend')} at {report['backend'].get('url')}"
        + independence(report),
    )
    table.add_column("layer")
    table.add_column("median", justify="right")
    table.add_column("worst", justify="right")
    for layer in report["layers"]:
        table.add_row(layer["name"], *(f"{layer[k]:.4f}" if layer[k] is not None else "-" for k in ("median", "worst")))
    for failure in report["failures"]:
        table.add_row(f"[red]{failure['sample_id']}[/]", "", "; ".join(failure["reasons"]))
    return table


def independence(report: dict) -> str:
    """What the audit's backend says about the extracting one: a check by the same kind of server is no check of it."""
    source = report.get("source_backend") or {}
    if report.get("independent") is False:
        return (
            f"\n[yellow]the same kind of server ({source.get('backend')}) extracted these states: a defect of that "
            "server itself is not caught (--backend reference, with EAGLE3_REFERENCE_URL set, recomputes with the "
            "transformers reference server)[/]"
        )
    return f"; extracted by {source['backend']} {source.get('version', '')}" if source else ""


def watch_regeneration(record: dict, api: httpx.Client, *, watch_it: bool) -> None:
    plan = record["regeneration"]
    console.print(
        f"submitted [bold]{record['job_id']}[/]: {record['samples_total']} conversations "
        f"({record['samples_rejected']} rejected), {plan['assistant_turns_total']} assistant turns to regenerate, "
        f"{record['shards_total']} shards; output {plan['output_key']}"
        + (f" and {plan['output_url']}" if plan["output_url"] else "")
    )
    if plan["chained_job_id"]:
        console.print(f"then extraction job [bold]{plan['chained_job_id']}[/] on the regenerated conversations")
    if record["spec"]["then_train"]:
        console.print(f"train on it with: eagle3 train --job {record['job_id']} --follow")
    if not watch_it:
        return
    p = watch(record["job_id"], api)
    console.print(progress_table(p))
    chained = p.regeneration.chained_job_id if p.regeneration else None
    if chained is not None:
        console.print(progress_table(watch(chained, api)))


def cmd_status(args: argparse.Namespace, settings: Settings) -> None:
    with api_client(settings) as api:
        p = watch(args.job_id, api) if args.watch else read_progress(api, args.job_id)
    if args.json:
        print(p.model_dump_json(indent=2))
    else:
        console.print(progress_table(p))


def cmd_jobs(args: argparse.Namespace, settings: Settings) -> None:
    table = Table("job", "kind", "state", "tokens", "samples", "shards", "dead", "tokens/s", "stored")
    with api_client(settings) as api:
        jobs = list_progress(api, older_than=args.older_than)
    for p in jobs:
        table.add_row(
            p.job_id,
            p.kind,
            p.state,
            f"{p.tokens_done}/{p.tokens_total}",
            f"{p.samples_done}/{p.samples_total}",
            f"{p.shards_committed}/{p.shards_total}",
            str(p.shards_dead_lettered),
            f"{p.tokens_per_second:.0f}",
            human_size(p.bytes_stored),
        )
    console.print(table)


def cmd_cancel(args: argparse.Namespace, settings: Settings) -> None:
    with api_client(settings) as api:
        console.print(check(api.post(f"/v1/jobs/{args.job_id}/cancel"))["state"])


def cmd_resume(args: argparse.Namespace, settings: Settings) -> None:
    with api_client(settings) as api:
        check(api.post(f"/v1/jobs/{args.job_id}/resume"))
        if args.watch:
            console.print(progress_table(watch(args.job_id, api)))


def exit_on_sigterm() -> None:
    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def cmd_up(args: argparse.Namespace, settings: Settings) -> None:
    exit_on_sigterm()
    if not settings.dataset_roots:  # local datasets: the configured roots, else a folder of this stack's own
        data_dir = (settings.home / "data").resolve()
        data_dir.mkdir(parents=True, exist_ok=True)
        settings = settings.model_copy(update={"dataset_roots": [str(data_dir)]})
    token_file = access.session_token_file(settings)
    try:
        with LocalStack(settings, workers=args.workers, log_dir=settings.home / "logs") as stack:
            if stack.api_token is not None and settings.api_token is None:
                access.write_session_token(settings, stack.api_url, stack.api_token)  # for the CLI in another shell
            console.print(
                f"stack up: producer {stack.api_url} (dashboard {stack.api_url}/dashboard), "
                f"inference {stack.env['EAGLE3_INFERENCE_URL']}, {args.workers} workers; logs in "
                f"{settings.home / 'logs'}. Datasets: under {', '.join(settings.dataset_roots)} or "
                "`eagle3 submit --upload`. A process that exits is restarted; Ctrl-C stops everything."
            )
            while True:
                for line in stack.supervise():
                    console.print(f"[yellow]{line}[/yellow]")
                time.sleep(1)
    except KeyboardInterrupt:
        console.print("stopped")
    except Eagle3Error as exc:
        raise SystemExit(str(exc)) from exc
    finally:
        if settings.api_token is None:
            token_file.unlink(missing_ok=True)


def add_parsers(sub: argparse._SubParsersAction, command: str | None = None) -> None:
    """The job commands. A kind's own options are added to its command only when that command runs (or when every
    command is built, command None): reading them loads the kinds."""
    p = sub.add_parser("submit", help="submit an extraction job to the producer API")
    p.add_argument("dataset", help="JSONL path or URL (file://, s3://)")
    add_spec_options(p, EXTRACTION_OPTIONS)
    p.add_argument("--upload", action="store_true", help="upload the file instead of passing its path")
    p.add_argument("--watch", action="store_true", help="show a live progress bar until the job finishes")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser(
        "regenerate",
        help="submit a regenerate job: the target rewrites every assistant turn (docs/regeneration.md)",
        description="The extraction options (--max-length ... --shard-token-budget) apply to the chained extraction "
        "job (--then-extract).",
    )
    p.add_argument("dataset", help="JSONL path or URL (file://, s3://)")
    p.add_argument("--out", help="also write the regenerated JSONL here (under EAGLE3_DATASET_ROOTS, or s3://)")
    add_spec_options(p, EXTRACTION_OPTIONS)
    if command in (None, "regenerate"):
        add_kind_options(p, "regenerate")
    p.add_argument("--upload", action="store_true", help="upload the file instead of passing its path")
    p.add_argument("--watch", action="store_true", help="live progress until it (and the chained job) finishes")
    p.set_defaults(func=cmd_regenerate)

    p = sub.add_parser(
        "audit",
        help="re-check a job's committed hidden states: a seeded sample recomputed by an independent backend",
        description="Submits a job of kind audit, follows it, prints the errors per layer and every failed sample, "
        "and exits 1 when the audit failed. The verdict is kept with the job (`eagle3 train` warns on a failed one).",
    )
    p.add_argument("source_job_id", metavar="JOB", help="the extraction job to audit")
    add_spec_options(p, AUDIT_COMMON_OPTIONS)
    if command in (None, "audit"):
        add_kind_options(p, "audit")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_audit)

    p = sub.add_parser("status", help="token-weighted progress of a job")
    p.add_argument("job_id")
    p.add_argument("--watch", action="store_true")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("jobs", help="list jobs, with the bytes each stores")
    p.add_argument("--older-than", metavar="AGE", help="only finished jobs that finished longer ago (7d, 12h, 30m)")
    p.set_defaults(func=cmd_jobs)

    p = sub.add_parser("cancel", help="cancel a job: queued shards are skipped")
    p.add_argument("job_id")
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("resume", help="re-enqueue every shard without a manifest")
    p.add_argument("job_id")
    p.add_argument("--watch", action="store_true")
    p.set_defaults(func=cmd_resume)

    p = sub.add_parser("up", help="run the whole stack as local processes until Ctrl-C")
    p.add_argument("--workers", type=int, default=2)
    p.set_defaults(func=cmd_up)
