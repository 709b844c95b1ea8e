"""`eagle3 delete` and `eagle3 budget`, through the producer API: delete a job (or every finished job past an age) and
see or change the storage budgets while jobs run."""

import argparse
import re

import httpx
from rich.console import Console

from eagle3.api import api_client, check, list_progress
from shared.settings import Settings
from shared.sizes import human_bytes

console = Console()

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(b|kb|mb|gb|tb|kib|mib|gib|tib)?\s*$", re.IGNORECASE)
_UNIT_BYTES = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str) -> int | None:
    """'50GB', '512MiB', '1000000' -> bytes; 'none' -> None (unlimited)."""
    if text.strip().lower() == "none":
        return None
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"size {text!r}: bytes, or a number with a unit (50GB, 512MiB), or none")
    return round(float(match.group(1)) * _UNIT_BYTES[(match.group(2) or "b").lower()])


def human_size(n: int | None) -> str:
    """A size or a budget: decimal units, or unlimited."""
    return "unlimited" if n is None else human_bytes(n)


def delete_one(api: httpx.Client, job_id: str, args: argparse.Namespace) -> None:
    flags = {"cancel": args.cancel, "force": args.force, "with_checkpoints": args.with_checkpoints}
    report = check(api.delete(f"/v1/jobs/{job_id}", params={k: str(v).lower() for k, v in flags.items()}))
    again = " (it finished an earlier, interrupted delete)" if report["finished_earlier_delete"] else ""
    kept = f", {report['objects_kept']} kept under trainer/" if report["objects_kept"] else ""
    console.print(f"deleted [bold]{job_id}[/]: {report['objects_deleted']} objects{kept}{again}")


def cmd_delete(args: argparse.Namespace, settings: Settings) -> None:
    if (args.job_id is None) == (args.older_than is None):
        raise SystemExit("eagle3 delete: give a JOB or --older-than AGE")
    with api_client(settings) as api:
        if args.job_id is not None:
            delete_one(api, args.job_id, args)
            return
        expired = list_progress(api, older_than=args.older_than)
        if not expired:
            console.print(f"no finished job finished more than {args.older_than} ago")
            return
        for p in expired:
            console.print(f"{p.job_id}  {p.kind}  {p.state}  {human_size(p.bytes_stored)}")
        if not args.yes and input(f"delete these {len(expired)} jobs? [y/N] ").strip().lower() != "y":
            raise SystemExit("nothing deleted")
        for p in expired:
            delete_one(api, p.job_id, args)


def cmd_budget(args: argparse.Namespace, settings: Settings) -> None:
    with api_client(settings) as api:
        if args.size is None:
            status = check(api.get("/v1/budget"))
        else:
            update = {"storage_budget_bytes": parse_size(args.size), "job_id": args.job}
            status = check(api.put("/v1/budget", json=update))
            whose = f"job {args.job}" if args.job else "the store"
            console.print(f"budget of {whose} set to {human_size(update['storage_budget_bytes'])}")
    console.print(
        f"storage budget {human_size(status['storage_budget_bytes'])}, {human_size(status['stored_bytes'])} stored"
    )


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "delete",
        help="delete a job (its objects, Redis keys and index entry), or every finished job past an age",
        description="A running job must be cancelled first (--cancel does it), a job a running trainer follows needs "
        "--force; trainer checkpoints under the job stay unless --with-checkpoints. An interrupted delete leaves the "
        "job `deleting`: run the same command again to finish it.",
    )
    p.add_argument("job_id", nargs="?", metavar="JOB")
    p.add_argument("--older-than", metavar="AGE", help="every finished job that finished longer ago (7d, 12h, 30m)")
    p.add_argument("--yes", action="store_true", help="with --older-than: do not ask before deleting")
    p.add_argument("--cancel", action="store_true", help="cancel a running job first")
    p.add_argument("--force", action="store_true", help="delete although a running trainer follows the job")
    p.add_argument("--with-checkpoints", action="store_true", help="also delete {job}/trainer/ (checkpoints, curves)")
    p.set_defaults(func=cmd_delete)

    p = sub.add_parser(
        "budget",
        help="show or change the storage budget while jobs run (store-wide, or one job's with --job)",
        description="Without SIZE: the store-wide budget in force and the bytes stored. A job paused by a budget "
        "goes on by itself once its next shard fits.",
    )
    p.add_argument("size", nargs="?", metavar="SIZE", help="bytes, or with a unit (50GB, 512MiB); none: unlimited")
    p.add_argument("--job", metavar="JOB", help="change this job's own budget instead")
    p.set_defaults(func=cmd_budget)
