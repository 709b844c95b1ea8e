"""`eagle3` job commands, all through the producer API: one per job kind (submit, regenerate, audit: each built from
its kind's declaration), status (with a live progress bar), jobs, cancel, resume; and `up`, the stack as local
processes."""

import argparse
import json
import logging
import signal
import time
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

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
from shared.lifecycle.command import ResultTable
from shared.lifecycle.kind import JobKind
from shared.lifecycle.kinds import KINDS
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


# A kind's command (`eagle3 submit`, `regenerate`, `audit`, one per registered kind) is its declaration
# (JobKind.command, shared/lifecycle/command.py): built here, its options JobSpec's and the kind's fields (type,
# choices and help from the schema, so they cannot drift), what it shows after the submit the kind's `follow`.
FLAGS: dict[str, tuple[str, ...]] = {"model_path": ("--model", "--model-path")}
DATASET_HELP = "JSONL path or URL (file://, s3://)"


def add_spec_options(
    parser: argparse.ArgumentParser,
    names: tuple[str, ...],
    fields: dict[str, FieldInfo] = JobSpec.model_fields,
    flags: Mapping[str, tuple[str, ...]] = FLAGS,
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


def add_kind_command(sub: argparse._SubParsersAction, kind: JobKind) -> None:
    """`eagle3 <command>` of a kind: the dataset (a kind that reads one), its positionals, the common options it
    offers, every option of its own, --upload, --watch and --json as it declares them."""
    command = kind.command
    p = sub.add_parser(kind.command_name, help=command.help, description=command.description)
    if kind.reads_dataset:
        p.add_argument("dataset", help=DATASET_HELP)
    fields = JobSpec.model_fields | kind.options.model_fields
    for positional in command.positionals:
        p.add_argument(
            positional.field, metavar=positional.metavar, help=positional.help or fields[positional.field].description
        )
    add_spec_options(p, command.common_options)
    taken = {positional.field for positional in command.positionals}
    own = {name: field for name, field in kind.options.model_fields.items() if name not in taken}
    add_spec_options(p, tuple(own), own, command.flags)
    if kind.reads_dataset:
        p.add_argument("--upload", action="store_true", help="upload the file instead of passing its path")
    if command.watch_help is not None:
        p.add_argument("--watch", action="store_true", help=command.watch_help)
    if command.json_result:
        p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_kind, job_kind=kind.name)


def spec_of(args: argparse.Namespace, kind: JobKind) -> dict[str, Any]:
    """The submit body: the kind, and every field its command offers that was given."""
    names = (*kind.command.common_options, *kind.options.model_fields)
    given = {name: getattr(args, name) for name in names if getattr(args, name) not in (None, False)}
    for name in kind.command.local_paths:
        if name in given:
            given[name] = absolute(given[name])
    return {"kind": kind.name, **given}


def absolute(location: str) -> str:
    """A URL as given; a path on this machine made absolute, since the producer runs elsewhere."""
    return location if "://" in location else str(Path(location).resolve())


def cmd_kind(args: argparse.Namespace, settings: Settings) -> None:
    kind = KINDS[args.job_kind]
    spec = spec_of(args, kind)
    with api_client(settings) as api:
        if kind.reads_dataset:
            job = post_job(api, args.dataset, spec, upload=args.upload)
        else:
            job = check(api.post("/v1/jobs", json=spec))
        session = ApiSession(api, watching=getattr(args, "watch", False), as_json=getattr(args, "json", False))
        kind.follow(job["job"], session)


def post_job(api: httpx.Client, dataset: str, spec: dict, *, upload: bool) -> dict:
    """Submit a job of any kind: the dataset uploaded, or its path or URL passed for the producer to read."""
    if upload:
        with open(dataset, "rb") as f:
            return check(api.post("/v1/jobs/upload", files={"dataset": f}, data={"spec": json.dumps(spec)}))
    return check(api.post("/v1/jobs", json={**spec, "dataset_url": absolute(dataset)}))


class ApiSession:
    """What a kind's command does after its submit (CommandSession), through the producer API and this terminal; with
    --json, stdout holds the result alone and everything else goes to stderr."""

    def __init__(self, api: httpx.Client, *, watching: bool, as_json: bool) -> None:
        self.api = api
        self.watching = watching
        self.as_json = as_json
        self.out = Console(stderr=True) if as_json else console

    def say(self, markup: str) -> None:
        self.out.print(markup)

    def watch(self, job_id: str) -> JobProgress:
        return watch(job_id, self.api, out=self.out)

    def show_progress(self, progress: JobProgress) -> None:
        self.out.print(progress_table(progress))

    def get(self, path: str) -> Any | None:
        response = self.api.get(path)
        return None if response.status_code == 404 else check(response)

    def result(self, data: Mapping[str, Any], table: ResultTable) -> None:
        if self.as_json:
            print(json.dumps(data, indent=2))
        else:
            console.print(rich_table(table))

    def fail(self, message: str) -> NoReturn:
        raise SystemExit(message)


def rich_table(table: ResultTable) -> Table:
    rendered = Table(title=table.title, caption=table.caption or None)
    for column in table.columns:
        rendered.add_column(column, justify="right" if column in table.numeric else "left")
    for row in table.rows:
        rendered.add_row(*row)
    return rendered


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


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """The job commands: one per registered kind, then those of any job."""
    for kind in KINDS.values():
        add_kind_command(sub, kind)

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
