"""`eagle3 doctor`: everything a long run depends on, checked in a minute before it starts.

Each check returns a `Check` (pass, warn or fail, with the reason); one failing check never hides the others:

- redis: reachable, answers PING, and its version;
- storage: a probe object written, read back byte for byte, and deleted;
- each inference server: /health, then /get_model_info against the target (hidden size, layers, vocabulary,
  and the capture layers an SGLang server was launched with);
- layer ids: increasing, inside the target's decoder layers;
- budget: the dataset's projected size (tokens x bytes per token) against EAGLE3_STORAGE_BUDGET_BYTES and the
  free space of a local store;
- workers: how many beat recently (a warning when none does: the queue would only grow);
- end to end: one sample tokenized, captured, validated and committed under a scratch job id, then loaded by the
  trainer's own data loader for one training step. The trainer step is passed in (`TrainProbe`) because the
  trainer is a service and shared/ does not import services; the composition root (the CLI) wires it.
The scratch job is removed from storage and Redis afterwards.
"""

import itertools
import json
import logging
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlparse

import redis

from shared.capture.client import InferenceClient
from shared.capture.protocol import ModelInfo, default_aux_layer_ids
from shared.data.datasets import InvalidRecord, read_dataset
from shared.data.tokenization import ChatTokenizer
from shared.errors import Eagle3Error, InvalidSample
from shared.lifecycle import jobs, progress, shards
from shared.lifecycle.kind import ShardContext, TargetModel
from shared.lifecycle.kinds import EXTRACT
from shared.lifecycle.kinds.extract import bytes_per_token
from shared.lifecycle.schemas import JobSpec
from shared.ops import cluster
from shared.settings import Settings
from shared.sizes import human_bytes
from shared.storage import layout
from shared.storage.objects import Storage, open_storage

logger = logging.getLogger(__name__)

Status = Literal["pass", "warn", "fail"]
TrainProbe = Callable[[str, Settings], str]  # (scratch job id, settings) -> what the one step did; raises on failure
PROJECTION_SAMPLE_LINES = 2000  # dataset lines tokenized to project the whole dataset's size
_PROBE_CONVERSATION = {
    "messages": [
        {"role": "user", "content": "Before a week-long run, check every part once. What is a hidden state?"},
        {"role": "assistant", "content": "The vector a transformer layer passes to the next one, one per token."},
    ]
}


@dataclass
class Check:
    name: str
    status: Status
    detail: str
    seconds: float = 0.0


def _timed(name: str, run: Callable[[], tuple[Status, str]]) -> Check:
    started = time.monotonic()
    try:
        status, detail = run()
    except Exception as exc:  # a check reports what broke; it never stops the others
        status, detail = "fail", f"{type(exc).__name__}: {exc}"
    return Check(name, status, detail, time.monotonic() - started)


def check_redis(settings: Settings) -> Check:
    def run() -> tuple[Status, str]:
        client = redis.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=5)
        client.ping()
        return "pass", f"{_redacted(settings.redis_url)}: redis {client.info('server')['redis_version']}"

    return _timed("redis", run)


def check_storage(storage: Storage) -> Check:
    def run() -> tuple[Status, str]:
        key = f"doctor-probe-{uuid.uuid4().hex[:12]}/probe.bin"
        payload = uuid.uuid4().bytes * 4096  # 64 KiB
        storage.put(key, payload)
        try:
            if storage.get(key) != payload:
                return "fail", f"{storage.url}: the probe object read back differs from what was written"
        finally:
            storage.delete(key)
        if storage.exists(key):
            return "fail", f"{storage.url}: the probe object is still there after delete"
        return "pass", f"{storage.url}: wrote, read back and deleted a {len(payload) // 1024} KiB probe"

    return _timed("storage", run)


def check_inference(url: str, target: TargetModel, settings: Settings) -> tuple[Check, ModelInfo | None]:
    found: list[ModelInfo] = []

    def run() -> tuple[Status, str]:
        with InferenceClient(url, timeout_s=30, max_concurrency=1) as client:
            client.wait_ready(timeout_s=min(settings.inference_ready_timeout_s, 30))
            info = client.model_info()
        found.append(info)
        served = {
            "hidden_size": info.hidden_size,
            "num_hidden_layers": info.num_hidden_layers,
            "vocab_size": info.vocab_size,
        }
        wanted = {
            "hidden_size": target.hidden_size,
            "num_hidden_layers": target.num_hidden_layers,
            "vocab_size": target.vocab_size,
        }
        wrong = [f"{k} {served[k]} (target {wanted[k]})" for k in served if served[k] != wanted[k]]
        if wrong:
            return "fail", f"{url} serves {info.model_path} with {', '.join(wrong)}"
        if info.capture_aux_layer_ids is not None and sorted(info.capture_aux_layer_ids) != sorted(
            target.aux_layer_ids
        ):
            return "fail", (
                f"{url} was launched to capture layers {info.capture_aux_layer_ids}, the run wants "
                f"{target.aux_layer_ids} (EAGLE3_AUX_LAYER_IDS of the SGLang container)"
            )
        return "pass", (
            f"{url}: {info.backend} {info.version}, {info.model_path}, {info.num_hidden_layers} layers, "
            f"hidden {info.hidden_size}, {info.dtype}"
        )

    check = _timed(f"inference {url}", run)
    return check, (found[0] if found else None)


def check_layer_ids(target: TargetModel) -> Check:
    def run() -> tuple[Status, str]:
        ids, n = target.aux_layer_ids, target.num_hidden_layers
        if len(ids) != 3:
            return "fail", f"aux_layer_ids {ids}: EAGLE-3 captures exactly 3 layers"
        if sorted(set(ids)) != ids:
            return "fail", f"aux_layer_ids {ids}: must be strictly increasing"
        outside = [i for i in ids if not 0 <= i < n]
        if outside:
            return "fail", f"aux_layer_ids {ids}: {outside} outside the target's decoder layers [0, {n})"
        default = default_aux_layer_ids(n)
        note = "" if ids == default else f" (EAGLE-3's default for {n} layers is {default})"
        return "pass", f"aux_layer_ids {ids} of {n} layers, hidden size {target.hidden_size}{note}"

    return _timed("layer ids", run)


def check_budget(dataset_url: str | None, target: TargetModel, settings: Settings) -> Check:
    def run() -> tuple[Status, str]:
        if dataset_url is None:
            return "warn", "no --dataset given: the run's size was not projected"
        tokenizer = ChatTokenizer.from_pretrained(target.path)
        max_length = JobSpec.model_fields["max_length"].default  # what a job truncates to unless told otherwise
        lines = list(jobs.read_dataset_lines(dataset_url, settings))
        sampled, tokens = 0, 0
        for item in itertools.islice(read_dataset(lines), PROJECTION_SAMPLE_LINES):
            sampled += 1
            if isinstance(item, InvalidRecord):
                continue
            try:
                tokens += tokenizer.tokenize(item, max_length=max_length, length_policy="truncate").num_tokens
            except InvalidSample:
                continue
        if not sampled:
            return "fail", f"{dataset_url}: no record"
        per_token = bytes_per_token(target.hidden_size)
        projected = round(tokens * len(lines) / sampled) * per_token
        how = f"{tokens * len(lines) / sampled:,.0f} tokens" + (
            f" (from {sampled:,} of {len(lines):,} lines)" if sampled < len(lines) else ""
        )
        detail = f"{dataset_url}: about {how} x {per_token:,} bytes/token = {human_bytes(projected)}"
        limits = []
        if settings.storage_budget_bytes is not None:
            limits.append(("budget", settings.storage_budget_bytes))
        free = _free_bytes(settings.storage_url)
        if free is not None:
            limits.append(("free disk", free))
        for name, limit in limits:
            detail += f"; {name} {human_bytes(limit)}, headroom {human_bytes(limit - projected)}"
        if any(projected > limit for _, limit in limits):
            return "fail", detail
        return ("pass" if limits else "warn"), detail + (
            "" if limits else "; no budget set (EAGLE3_STORAGE_BUDGET_BYTES)"
        )

    return _timed("storage budget", run)


def check_workers(settings: Settings) -> Check:
    def run() -> tuple[Status, str]:
        client = redis.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=5)
        workers = cluster.list_workers(client, stale_after_s=3 * settings.worker_heartbeat_interval_s)
        alive = [w for w in workers if w.alive]
        if not alive:
            return "warn", f"no worker beat in the last {3 * settings.worker_heartbeat_interval_s:.0f}s: start some"
        slots = sum(w.concurrency for w in alive)
        return "pass", f"{len(alive)} live worker(s), {slots} slot(s); {len(workers) - len(alive)} silent"

    return _timed("workers", run)


def check_end_to_end(
    target: TargetModel, inference_url: str, settings: Settings, train_probe: TrainProbe | None, *, keep: bool = False
) -> list[Check]:
    """One sample through the real path into a scratch job, then the trainer's loader and one step on it."""
    job_id = f"doctor-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    storage = open_storage(settings.storage_url, settings)
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=30, socket_connect_timeout=10)
    checks: list[Check] = []
    try:
        with tempfile.TemporaryDirectory(prefix="eagle3-doctor-") as tmp:
            dataset = Path(tmp) / "probe.jsonl"
            dataset.write_text(json.dumps(_PROBE_CONVERSATION) + "\n")
            spec = JobSpec(
                dataset_url=str(dataset),
                model_path=str(target.path),
                job_id=job_id,
                aux_layer_ids=target.aux_layer_ids,
            )
            planned: list[int] = []

            def submit() -> tuple[Status, str]:
                job = jobs.submit(
                    spec,
                    settings=settings.model_copy(update={"dataset_roots": [*settings.dataset_roots, tmp]}),  # its own
                    storage=storage,
                    client=client,
                    enqueue=lambda _kind, _job, k: planned.append(k),
                )
                return "pass", f"scratch job {job_id}: {job.samples_total} sample, {job.tokens_total} tokens planned"

            # A local, not checks[-1]: the type checker would keep the first test's narrowing after an append.
            planning = _timed("e2e: tokenize and plan", submit)
            checks.append(planning)
            if planning.status == "fail":
                return checks

            def capture() -> tuple[Status, str]:
                # The worker's own shard lifecycle, run here against the first inference server.
                ctx = ShardContext(
                    storage=storage,
                    redis=client,
                    settings=settings.model_copy(update={"inference_url": inference_url}),
                    worker="doctor",
                )
                try:
                    outcome = shards.run_shard(EXTRACT, job_id, planned[0], ctx)
                finally:
                    for state in ctx.states.values():
                        state.close()
                if outcome.status != "committed":
                    return "fail", f"shard {planned[0]}: {outcome.status}"
                return "pass", (
                    f"captured, validated and committed {outcome.num_tokens} tokens ({human_bytes(outcome.bytes)}) to "
                    f"{storage.url.rstrip('/')}/{job_id}/ in {outcome.seconds:.1f}s"
                )

            capturing = _timed("e2e: capture, validate, commit", capture)
            checks.append(capturing)
            if capturing.status == "fail":
                return checks
            if train_probe is None:
                checks.append(Check("e2e: trainer loads, one step", "warn", "no trainer probe wired"))
            else:
                checks.append(_timed("e2e: trainer loads, one step", lambda: ("pass", train_probe(job_id, settings))))
    finally:
        if not keep:
            _remove_job(storage, client, job_id)
    return checks


def run_checks(
    settings: Settings,
    *,
    model_path: Path,
    aux_layer_ids: list[int] | None = None,
    dataset_url: str | None = None,
    inference_urls: list[str] | None = None,
    train_probe: TrainProbe | None = None,
    end_to_end: bool = True,
    keep_scratch: bool = False,
) -> list[Check]:
    target = TargetModel.read(model_path, aux_layer_ids)
    urls = inference_urls or [settings.inference_url]
    checks = [check_redis(settings), check_storage(open_storage(settings.storage_url, settings))]
    infos = []
    for url in urls:
        check, info = check_inference(url, target, settings)
        checks.append(check)
        infos.append(info)
    checks += [check_layer_ids(target), check_budget(dataset_url, target, settings), check_workers(settings)]
    if not end_to_end:
        return checks
    blocking = [c.name for c in checks if c.status == "fail" and c.name not in ("storage budget", "workers")]
    if blocking:
        checks.append(Check("end to end", "fail", f"not run: {', '.join(blocking)} failed"))
    else:
        checks += check_end_to_end(target, urls[0], settings, train_probe, keep=keep_scratch)
    return checks


def _remove_job(storage: Storage, client: redis.Redis, job_id: str) -> None:
    try:
        for key in storage.list(f"{job_id}/"):
            storage.delete(key)
        storage.delete(layout.job_index_entry(job_id))
    except Eagle3Error as exc:
        logger.warning("scratch job %s: could not remove its files: %s", job_id, exc)
    try:
        with client.pipeline() as pipe:
            pipe.delete(
                progress.job_key(job_id),
                progress.committed_key(job_id),
                progress.dead_key(job_id),
                progress.events_key(job_id),
            )
            pipe.zrem(progress.JOBS_INDEX, job_id)
            pipe.execute()
    except redis.RedisError as exc:
        logger.warning("scratch job %s: could not remove its Redis keys: %s", job_id, exc)


def _free_bytes(storage_url: str) -> int | None:
    parsed = urlparse(storage_url)
    if parsed.scheme not in ("", "file"):
        return None  # an object store reports no free space
    path = Path(parsed.path if parsed.scheme else storage_url)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def _redacted(url: str) -> str:
    parsed = urlparse(url)
    if parsed.password:
        return url.replace(f":{parsed.password}@", ":***@")
    return url
