"""`eagle3 worker`: a Celery worker consuming extraction and regeneration shards (one queue)."""

import argparse
from pathlib import Path

from shared.lifecycle.queue import SHARD_QUEUE
from shared.settings import Settings


def cmd_worker(args: argparse.Namespace, settings: Settings) -> None:
    from services.worker.celery_app import app

    concurrency = args.concurrency or settings.worker_concurrency
    app.worker_main(
        [
            "worker",
            "--queues",
            SHARD_QUEUE,
            "--concurrency",
            str(concurrency),
            "--pool",
            "prefork",
            "--hostname",
            args.name,
            "--loglevel",
            args.loglevel,
            "--without-gossip",
            "--without-mingle",
        ]
    )


def cmd_worker_probe(args: argparse.Namespace, settings: Settings) -> None:
    # A liveness probe: local and cheap (no broker round trip), see services/worker/heartbeat.py.
    from services.worker import heartbeat

    path = args.file or heartbeat.heartbeat_file()
    reason = heartbeat.stale_reason(path, args.max_age)
    if reason is not None:
        raise SystemExit(reason)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="run a Celery worker for extraction and regeneration shards")
    p.add_argument("--concurrency", type=int, help="shards processed at once (default EAGLE3_WORKER_CONCURRENCY)")
    p.add_argument("--name", default="worker@%h")
    p.add_argument("--loglevel", default="INFO")
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("worker-probe", help="liveness: fail if the worker's heartbeat file is stale (not consuming)")
    p.add_argument("--max-age", type=float, default=120.0, help="seconds (default 120)")
    p.add_argument("--file", type=Path, help="heartbeat file (default EAGLE3_WORKER_HEARTBEAT_FILE)")
    p.set_defaults(func=cmd_worker_probe)
