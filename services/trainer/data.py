"""Training data from a job's committed shards: which shards exist, the held-out split, verified sample files
in a local cache, and token-budget batches with a position that a checkpoint can save and restore.

Notable:
- Storage is the truth. On start (and restart) the committed shards are recovered from the manifests; with
  `follow=True` the Redis shard-event stream then announces new commits, and a periodic re-listing of the
  manifests covers events lost with a flushed Redis. Following ends once the job is finished and every manifest
  has been read.
- job.json and every manifest are checked against the target the trainer was started for (aux layer ids,
  hidden size, target model shape); a mismatch is refused with the job, field and both values, never trained on.
- The held-out split is by shard and fixed from the job's planned shard count before any shard is seen, so a
  shard that trained can never later become held out.
- Batches are planned from manifest metadata alone (per-sample token counts), so every DDP rank plans the same
  batches without reading a tensor and then loads only its own. All randomness derives from (seed, epoch, pool),
  so a data position is a handful of ints and a resumed run replays exactly the same batches.
- Sample files are verified against the manifest (size, sha256) before use and kept in a local LRU cache under a
  disk budget; a missing or corrupted object is skipped with a logged reason and counted, and training goes on.
"""

import contextlib
import functools
import hashlib
import logging
import math
import multiprocessing.context
import os
import pickle
import random
import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import redis
import torch
import torch.distributed as dist
import torch.multiprocessing
from prometheus_client import Counter as PromCounter
from pydantic import BaseModel, Field

from services.trainer.loss import Batch, with_token_embeds
from shared.data.model_assets import language_model_config
from shared.errors import ConfigurationError, Eagle3Error, StorageUnavailable
from shared.lifecycle import followers, progress
from shared.lifecycle.schemas import JobRecord, Manifest, ManifestSample
from shared.redis_replies import read_streams, text
from shared.storage import layout
from shared.storage.objects import ObjectNotFound, Storage
from shared.storage.sample_format import HIDDEN_DTYPE, NUM_AUX_LAYERS, InvalidCapture, decode_sample

logger = logging.getLogger(__name__)

SKIPPED_SAMPLES = PromCounter(
    "eagle3_trainer_skipped_samples", "Sample files skipped by the trainer (missing or corrupted)", ["job_id", "reason"]
)

STORAGE_ATTEMPTS = 4  # a storage outage is retried with backoff (1, 2, 4 s) before the run fails
NOT_READY: Literal["not_ready"] = "not_ready"  # following a job: no new committed shard yet


class IncompatibleJob(Eagle3Error):
    """A job or shard captured for another target than the one the trainer was started for."""

    def __init__(self, job_id: str, source: str, field: str, found: object, expected: object) -> None:
        super().__init__(
            f"job {job_id}: {source}: {field} is {found}, but the trainer was started for {expected}; "
            "train a new run for this job instead"
        )
        self.job_id, self.source, self.field, self.found, self.expected = job_id, source, field, found, expected


class SkippedSample(Eagle3Error):
    """One sample file that cannot be used (missing, wrong size, wrong sha256, undecodable, wrong shape)."""

    def __init__(self, key: str, reason: str, detail: str) -> None:
        super().__init__(f"{key}: {reason}: {detail}")
        self.key, self.reason, self.detail = key, reason, detail


# ---------------------------------------------------------------------------------------------------------------------
# Which shards: compatibility, held-out split, following


@dataclass(frozen=True)
class TargetSignature:
    """What the trainer was started for; every job.json and manifest it reads must agree."""

    aux_layer_ids: tuple[int, ...]
    hidden_size: int
    num_hidden_layers: int
    architecture: str

    @classmethod
    def from_model_config(cls, config: dict[str, Any], aux_layer_ids: list[int]) -> "TargetSignature":
        """From the target's Hugging Face config.json and the aux layer ids the drafter consumes."""
        language_model = language_model_config(config)
        return cls(
            aux_layer_ids=tuple(aux_layer_ids),
            hidden_size=int(language_model["hidden_size"]),
            num_hidden_layers=int(language_model["num_hidden_layers"]),
            architecture=(config.get("architectures") or ["unknown"])[0],
        )


def check_job(job: JobRecord, expected: TargetSignature) -> None:
    found = {
        "aux_layer_ids": tuple(job.aux_layer_ids),
        "hidden_size": job.hidden_size,
        "num_hidden_layers": job.model.num_hidden_layers,
        "architecture": job.model.architecture,
    }
    for name, value in found.items():
        if value != getattr(expected, name):
            raise IncompatibleJob(job.job_id, "job.json", name, _show(value), _show(getattr(expected, name)))


def check_manifest(manifest: Manifest, job_id: str, expected: TargetSignature) -> None:
    source = layout.manifest(job_id, manifest.shard_index).removeprefix(f"{job_id}/")
    found = {"aux_layer_ids": tuple(manifest.aux_layer_ids), "hidden_size": manifest.hidden_size}
    for name, value in found.items():
        if value != getattr(expected, name):
            raise IncompatibleJob(job_id, source, name, _show(value), _show(getattr(expected, name)))
    if manifest.job_id != job_id:
        raise IncompatibleJob(job_id, source, "job_id", manifest.job_id, job_id)
    if manifest.dtype != "bfloat16":
        raise IncompatibleJob(job_id, source, "dtype", manifest.dtype, "bfloat16")


def _show(value: object) -> object:
    return list(value) if isinstance(value, tuple) else value


def heldout_shards(shards_total: int, fraction: float) -> frozenset[int]:
    """The shards that never train: ceil(fraction * shards_total) of them, chosen by a hash of the shard index,
    at least one when there are two or more shards and fraction > 0, and never all of them."""
    if fraction <= 0 or shards_total < 2:
        return frozenset()
    count = min(shards_total - 1, max(1, math.ceil(fraction * shards_total)))
    ranked = sorted(range(shards_total), key=lambda index: hashlib.sha256(f"heldout:{index}".encode()).digest())
    return frozenset(ranked[:count])


class ShardSource(Protocol):
    def poll(self, *, block: bool) -> list[Manifest] | None:
        """Newly committed training shards ([] when none yet); None once no more will come."""
        ...


class ShardFollower:
    """The committed shards of one job, recovered from the manifests, then (follow=True) from the shard events."""

    def __init__(
        self,
        job: JobRecord,
        *,
        storage: Storage,
        expected: TargetSignature,
        redis_client: redis.Redis | None = None,
        follow: bool = False,
        heldout_fraction: float = 0.05,
        block_s: float = 1.0,
        relist_interval_s: float = 30.0,
    ) -> None:
        if follow and redis_client is None:
            raise ConfigurationError(f"job {job.job_id}: following shard events needs a Redis client")
        check_job(job, expected)
        self.job, self.storage, self.expected = job, storage, expected
        self.redis_client, self.follow = redis_client, follow
        self.block_s, self.relist_interval_s = block_s, relist_interval_s
        self.heldout = heldout_shards(job.shards_total, heldout_fraction)
        self.manifests: dict[int, Manifest] = {}  # every committed shard seen so far, held-out ones included
        self.dead_lettered: set[int] = set()
        self._last_event_id = "0-0"  # the stream from its beginning: events before our start are deduplicated
        self._last_listing = -math.inf
        self._done = False
        # While this trainer runs, the job is not deleted (without --force) nor its shard events trimmed.
        self.mark = followers.FollowerMark(redis_client, job.job_id) if follow and redis_client is not None else None

    @property
    def job_id(self) -> str:
        return self.job.job_id

    def heldout_manifests(self) -> list[Manifest]:
        return [self.manifests[i] for i in sorted(self.manifests) if i in self.heldout]

    def poll(self, *, block: bool = True) -> list[Manifest] | None:
        """Training shards learned since the last call, in commit order; [] if none yet; None once none will come.

        block=True waits up to block_s for a shard event. Without follow, the first call returns what is committed
        and the next returns None.
        """
        if self._done:
            return None
        fresh = self._relist() if self._last_listing == -math.inf else []
        if not self.follow:
            self._done = True
            return self._training(fresh) or None
        fresh += self._read_events(block_ms=round(self.block_s * 1000) if block and not fresh else None)
        if time.monotonic() - self._last_listing >= self.relist_interval_s:
            fresh += self._relist()
        if not self._training(fresh) and self._job_finished():
            # Commits are counted in the same Redis script that appends their event, so once the job reads as
            # finished every event is in the stream; listing storage as well makes the end independent of Redis.
            fresh += self._read_events(block_ms=None) + self._relist()
            if not self._training(fresh):
                self._done = True
                logger.info(
                    "job %s finished: %d committed shards (%d held out), %d dead-lettered",
                    self.job_id,
                    len(self.manifests),
                    len(self.heldout & self.manifests.keys()),
                    len(self.dead_lettered),
                )
                return None
        return self._training(fresh)

    def _training(self, manifests: list[Manifest]) -> list[Manifest]:
        return [m for m in manifests if m.shard_index not in self.heldout]

    def _job_finished(self) -> bool:
        assert self.redis_client is not None
        return progress.job_progress(self.redis_client, self.job_id).finished

    def _relist(self) -> list[Manifest]:
        self._last_listing = time.monotonic()
        fresh = []
        for key in self.storage.list(layout.manifests_prefix(self.job_id)):
            index = layout.shard_index_from_manifest_key(key)
            if index not in self.manifests:
                fresh.append(self._load(key))
        if fresh:
            logger.info("job %s: %d committed shards found in storage", self.job_id, len(fresh))
        return fresh

    def _read_events(self, *, block_ms: int | None) -> list[Manifest]:
        """Shard events after the last one seen; block_ms=None does not wait (redis-py reads block=0 as forever)."""
        assert self.redis_client is not None
        reply = self.redis_client.xread({progress.events_key(self.job_id): self._last_event_id}, block=block_ms)
        fresh = []
        for _stream, entries in read_streams(reply):
            for entry_id, raw in entries:
                self._last_event_id = text(entry_id)
                fields = {text(k): text(v) for k, v in raw.items()}
                index = int(fields["shard_index"])
                if fields["event"] == "dead_lettered":
                    if index not in self.dead_lettered:
                        self.dead_lettered.add(index)
                        logger.warning(
                            "job %s shard %d dead-lettered, training without it: %s",
                            self.job_id,
                            index,
                            fields.get("reason", ""),
                        )
                elif fields["event"] == "committed" and index not in self.manifests:
                    try:
                        fresh.append(self._load(fields.get("manifest") or layout.manifest(self.job_id, index)))
                    except ObjectNotFound:
                        # An event without its manifest (storage wiped, stream left over): storage is the truth.
                        logger.warning(
                            "job %s shard %d: event without a manifest in storage, ignored", self.job_id, index
                        )
        if fresh:
            logger.info("job %s: %d shards committed since the last event read", self.job_id, len(fresh))
        return fresh

    def _load(self, key: str) -> Manifest:
        manifest = Manifest.model_validate_json(_retry(lambda: self.storage.get(key), key))
        check_manifest(manifest, self.job_id, self.expected)
        self.manifests[manifest.shard_index] = manifest
        return manifest


class BroadcastShardSource:
    """Rank 0 follows the job and broadcasts each answer, so every rank plans from the same shards in the same
    order even though shards are committed while ranks run at slightly different times."""

    def __init__(self, follower: ShardFollower | None, group: dist.ProcessGroup | None) -> None:
        self.follower, self.group = follower, group

    def poll(self, *, block: bool) -> list[Manifest] | None:
        payload: list[list[Manifest] | Eagle3Error | None] = [None]
        if dist.get_rank() == 0:
            assert self.follower is not None
            try:
                payload[0] = self.follower.poll(block=block)
            except Eagle3Error as exc:  # every rank must raise it, or the others wait in the broadcast forever
                payload[0] = exc
        dist.broadcast_object_list(payload, src=0, group=self.group)
        if isinstance(payload[0], Eagle3Error):
            raise payload[0]
        return payload[0]


# ---------------------------------------------------------------------------------------------------------------------
# Batches: planned from metadata, with a resumable position


class DataPosition(BaseModel):
    """Where the batch stream stands. Plain ints, so a checkpoint loads with torch.load(weights_only=True)."""

    seed: int
    epoch: int = 0
    epoch_shards: list[int] = Field(default_factory=list, description="this epoch's shard order; epoch 0 grows")
    pool_start: int = 0  # index into epoch_shards of the current pool's first shard
    pool_end: int = 0  # one past its last shard
    next_batch: int = 0  # batches of the current pool already handed out
    batches_planned: int = 0  # over the whole run


@dataclass(frozen=True)
class PlannedBatch:
    samples: tuple[ManifestSample, ...]
    length: int  # T: the longest sample after truncation; the batch is B x T padded

    @property
    def num_tokens(self) -> int:
        return sum(min(s.num_tokens, self.length) for s in self.samples)


class BatchPlanner:
    """Token-budget batches over the training shards, epoch after epoch.

    Shards are taken in pools of about `pool_tokens`; a pool's samples are shuffled, sorted by length (so a
    batch pads little) and packed greedily while B * T_max <= batch_tokens, then the batch order is shuffled.
    Epoch 0 follows the commit order (shards committed together are shuffled among themselves); later epochs
    permute all training shards.
    """

    def __init__(
        self,
        source: ShardSource,
        *,
        batch_tokens: int,
        max_length: int,
        epochs: int,
        position: DataPosition,
        pool_tokens: int | None = None,
        sort_by_length: bool = True,
    ) -> None:
        if batch_tokens < 1 or max_length < 2 or epochs < 1:
            raise ConfigurationError(
                f"batch_tokens={batch_tokens}, max_length={max_length}, epochs={epochs}: need >= 1, >= 2, >= 1"
            )
        self.source = source
        self.batch_tokens = batch_tokens
        self.max_length = min(max_length, batch_tokens)  # one sample must fit a batch
        self.epochs = epochs
        self.pool_tokens = pool_tokens or 16 * batch_tokens
        self.sort_by_length = sort_by_length
        self.position = position.model_copy(deep=True)
        self.manifests: dict[int, Manifest] = {}
        self._plan: list[PlannedBatch] | None = None  # the current pool's batches
        self._polled = False
        self._source_done = False

    def next_batch(self, *, block: bool = True) -> PlannedBatch | Literal["not_ready"] | None:
        """The next batch; NOT_READY when following and no new shard arrived within the source's wait; None at
        the end of the last epoch."""
        pos = self.position
        while True:
            if not self._polled:  # the first answer also carries the manifests that a restored position names
                if not self._poll(block):
                    return NOT_READY
                continue
            if pos.pool_end > pos.pool_start:
                if self._plan is None:  # restored mid-pool: the same plan again, from the same seed
                    self._plan = self._plan_pool()
                if pos.next_batch < len(self._plan):
                    batch = self._plan[pos.next_batch]
                    pos.next_batch += 1
                    pos.batches_planned += 1
                    return batch
            if pos.pool_end < len(pos.epoch_shards):
                self._open_pool()
                continue
            if pos.epoch == 0 and not self._source_done:
                if not self._poll(block):
                    return NOT_READY
                continue
            if pos.epoch + 1 >= self.epochs or not pos.epoch_shards:
                return None
            pos.epoch += 1
            pos.epoch_shards = self._permuted(sorted(pos.epoch_shards), f"epoch:{pos.epoch}")
            pos.pool_start = pos.pool_end = pos.next_batch = 0
            self._plan = None
            logger.info("epoch %d: %d training shards", pos.epoch, len(pos.epoch_shards))

    def _poll(self, block: bool) -> bool:
        """Ask the source for shards; False if it has none yet."""
        answer = self.source.poll(block=block)
        self._polled = True
        if answer is None:
            self._source_done = True
            return True
        for manifest in answer:
            self.manifests[manifest.shard_index] = manifest
        known = set(self.position.epoch_shards)
        new = sorted(m.shard_index for m in answer if m.shard_index not in known)
        if new and self.position.epoch == 0:
            # Shards learned together are shuffled among themselves; the salt is where they land in the order.
            self.position.epoch_shards.extend(self._permuted(new, f"arrival:{len(self.position.epoch_shards)}"))
        return bool(answer)

    def _open_pool(self) -> None:
        pos = self.position
        pos.pool_start = end = pos.pool_end
        tokens = 0
        while end < len(pos.epoch_shards) and (end == pos.pool_start or tokens < self.pool_tokens):
            manifest = self.manifests.get(pos.epoch_shards[end])
            tokens += manifest.num_tokens if manifest else 0
            end += 1
        pos.pool_end, pos.next_batch = end, 0
        self._plan = self._plan_pool()

    def _plan_pool(self) -> list[PlannedBatch]:
        pos = self.position
        rng = random.Random(f"{pos.seed}:{pos.epoch}:{pos.pool_start}")
        samples: list[ManifestSample] = []
        for index in pos.epoch_shards[pos.pool_start : pos.pool_end]:
            manifest = self.manifests.get(index)
            if manifest is None:  # named by a restored position but no longer in storage
                logger.warning("shard %d of the restored data position is not committed any more; skipped", index)
                continue
            # A sample without a loss token teaches nothing and would only cost a forward pass.
            samples.extend(s for s in manifest.samples if s.loss_tokens > 0)
        rng.shuffle(samples)
        if self.sort_by_length:
            samples.sort(key=lambda s: min(s.num_tokens, self.max_length))  # stable: ties stay shuffled
        batches: list[PlannedBatch] = []
        current: list[ManifestSample] = []
        longest = 0
        for sample in samples:
            length = min(sample.num_tokens, self.max_length)
            if current and (len(current) + 1) * max(longest, length) > self.batch_tokens:
                batches.append(PlannedBatch(tuple(current), longest))
                current, longest = [], 0
            current.append(sample)
            longest = max(longest, length)
        if current:
            batches.append(PlannedBatch(tuple(current), longest))
        if self.sort_by_length:
            rng.shuffle(batches)  # otherwise each pool would run from short to long batches
        return batches

    def _permuted(self, indices: list[int], salt: str) -> list[int]:
        order = list(indices)
        random.Random(f"{self.position.seed}:{salt}").shuffle(order)
        return order


def plan_all(manifests: list[Manifest], *, batch_tokens: int, max_length: int, seed: int = 0) -> list[PlannedBatch]:
    """Every batch of a fixed set of shards, once (held-out evaluation)."""
    planner = BatchPlanner(
        _FixedSource(manifests),
        batch_tokens=batch_tokens,
        max_length=max_length,
        epochs=1,
        position=DataPosition(seed=seed),
    )
    batches = []
    while (batch := planner.next_batch()) is not None:
        assert batch != NOT_READY  # a fixed source is always ready
        batches.append(batch)
    return batches


class _FixedSource:
    def __init__(self, manifests: list[Manifest]) -> None:
        self._manifests: list[Manifest] | None = manifests

    def poll(self, *, block: bool) -> list[Manifest] | None:
        answer, self._manifests = self._manifests, None
        return answer or None


# ---------------------------------------------------------------------------------------------------------------------
# Sample files: local cache, verification, collation


class SampleCache:
    """Verified sample files on local disk, named by sha256; least recently used are evicted to stay under
    `budget_bytes`. It survives a restart: recency is the file mtime."""

    def __init__(self, directory: Path, budget_bytes: int) -> None:
        self.directory, self.budget_bytes = directory, budget_bytes
        directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, int] = OrderedDict()  # sha256 -> bytes, least recently used first
        self.used_bytes = 0
        found = []
        for path in directory.iterdir():
            if path.name.startswith(".tmp-"):  # a write interrupted by a crash
                path.unlink(missing_ok=True)
            elif path.is_file():
                stat = path.stat()
                found.append((stat.st_mtime, path.name, stat.st_size))
        for _, name, size in sorted(found):
            self._entries[name] = size
            self.used_bytes += size
        self._evict(0)

    def get(self, sha256: str, size: int) -> bytes | None:
        path = self.directory / sha256
        try:
            data = path.read_bytes()
        except FileNotFoundError:  # never cached, or evicted by another thread meanwhile
            return None
        with self._lock:
            if len(data) != size:  # truncated on local disk: drop it and download again
                self._drop(sha256)
                return None
            if sha256 in self._entries:
                self._entries.move_to_end(sha256)
        with contextlib.suppress(FileNotFoundError):  # evicted by another thread since the read
            os.utime(path)  # recency that survives a restart
        return data

    def put(self, sha256: str, data: bytes) -> None:
        if len(data) > self.budget_bytes or sha256 in self._entries:
            return
        tmp = self.directory / f".tmp-{uuid.uuid4().hex}"
        tmp.write_bytes(data)
        self.adopt(sha256, tmp, len(data))

    def adopt(self, sha256: str, written: Path, size: int) -> None:
        """Take a verified copy written under a temporary name in the cache's folder (by this process or a reading
        process) as the entry of `sha256`; a copy not wanted (already cached, or over the budget) is removed."""
        with self._lock:
            if sha256 in self._entries or size > self.budget_bytes:
                written.unlink(missing_ok=True)
                return
            self._evict(size)
            os.replace(written, self.directory / sha256)
            self._entries[sha256] = size
            self.used_bytes += size

    def _evict(self, incoming: int) -> None:
        while self._entries and self.used_bytes + incoming > self.budget_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, sha256: str) -> None:
        self.used_bytes -= self._entries.pop(sha256, 0)
        (self.directory / sha256).unlink(missing_ok=True)


@dataclass
class DataStats:
    samples_loaded: int = 0
    tokens_loaded: int = 0
    skipped: Counter[str] = field(default_factory=Counter)  # reason -> samples

    def as_dict(self) -> dict[str, Any]:
        return {
            "samples_loaded": self.samples_loaded,
            "tokens_loaded": self.tokens_loaded,
            "skipped_samples": sum(self.skipped.values()),
            "skipped_by_reason": dict(self.skipped),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DataStats":
        return cls(data["samples_loaded"], data["tokens_loaded"], Counter(data["skipped_by_reason"]))

    def add(self, other: "DataStats") -> None:
        self.samples_loaded += other.samples_loaded
        self.tokens_loaded += other.tokens_loaded
        self.skipped.update(other.skipped)


def usable_memory_bytes() -> int:
    """The memory this process may use: its cgroup's limit where one is set (a container's), else the machine's."""
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):  # v2, v1
        with contextlib.suppress(OSError):
            text = Path(limit_file).read_text().strip()
            if text.isdigit():  # v2 says "max" without a limit, v1 a number beyond the machine's memory
                return min(int(text), physical)
    return physical


class DecodedSampleCache:
    """Verified, decoded samples kept in host memory for the epochs after the first, keyed by the file's sha256.

    Reading a sample again costs a read, a sha256 and an unpickling that holds the GIL, which the training step's
    own Python needs to launch its kernels: with many small samples (a small target's conversations of a few
    hundred tokens) the readers slow the step even when it never waits for them (the GPU demo on an H100,
    2026-12-05: 88-92K tokens/s in the first epoch, 140-145K once every sample came from here). Samples are kept
    until `budget_bytes` is full and never evicted: with epochs in a new order each time, any eviction policy would
    throw out what the next epoch needs as often as not, and what stays hits on every later epoch."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self.hits = self.misses = 0
        self._records: dict[str, dict[str, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def get(self, sha256: str) -> dict[str, torch.Tensor] | None:
        with self._lock:
            record = self._records.get(sha256)
            if record is None:
                self.misses += 1
            else:
                self.hits += 1
            return record

    def put(self, sha256: str, record: dict[str, torch.Tensor]) -> None:
        size = sum(tensor.nbytes for tensor in record.values())
        with self._lock:
            if sha256 not in self._records and self.used_bytes + size <= self.budget_bytes:
                self._records[sha256] = record
                self.used_bytes += size


class SampleLoader:
    """Fetches the samples of a planned batch (in parallel), verifies them against the manifest and collates a
    right-padded `Batch`; a sample that cannot be used is skipped, logged with its reason and counted."""

    def __init__(
        self,
        storage: Storage,
        *,
        job_id: str,
        hidden_size: int,
        cache: SampleCache | None = None,
        decoded: DecodedSampleCache | None = None,
        io_threads: int = 4,
        read_processes: int = 0,
        stats: DataStats | None = None,
        token_embedding: torch.Tensor | None = None,
        pin_memory: bool = False,
    ) -> None:
        self.storage, self.job_id, self.hidden_size, self.cache = storage, job_id, hidden_size, cache
        self.decoded = decoded
        self.token_embedding = token_embedding  # [V, H] on the host: each batch gets its tokens' embeddings
        self.pin_memory = pin_memory  # batches in page-locked memory, for a GPU to copy without blocking the step
        self.stats = stats or DataStats()
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="sample-io")
        # With read_processes, a sample's read, sha256 and decode run in processes of their own (see
        # `read_in_process`), each thread of the pool above waiting for one: the training process keeps its GIL.
        self._readers = (
            ProcessPoolExecutor(
                max_workers=read_processes,
                mp_context=reading_context(),
                initializer=_open_reading_process,
                initargs=(storage,),
            )
            if read_processes > 0
            else None
        )
        if self._readers is not None:
            # Started now, not by the first batch: the first loader of a training process also starts the fork
            # server, which imports torch and this module (seconds) that a step waiting for its first batch would pay.
            for started in [self._readers.submit(os.getpid) for _ in range(read_processes)]:
                started.result()
        self._lock = threading.Lock()

    def close(self) -> None:
        self._pool.shutdown()
        if self._readers is not None:
            self._readers.shutdown()

    def load(self, planned: PlannedBatch, stats: DataStats | None = None) -> Batch | None:
        """The collated batch, or None if every sample of it was skipped. Counts into `stats` (default: the
        loader's own), so that a batch loaded ahead is counted only once it is used."""
        stats = self.stats if stats is None else stats
        records = [
            r for r in self._pool.map(lambda s: self._fetch(s, planned.length, stats), planned.samples) if r is not None
        ]
        if not records:
            return None
        batch = collate(records, pin_memory=self.pin_memory)
        return batch if self.token_embedding is None else with_token_embeds(batch, self.token_embedding)

    def _fetch(self, sample: ManifestSample, max_length: int, stats: DataStats) -> dict[str, torch.Tensor] | None:
        try:
            record = self._verified_record(sample)
        except SkippedSample as exc:
            with self._lock:
                stats.skipped[exc.reason] += 1
            SKIPPED_SAMPLES.labels(self.job_id, exc.reason).inc()
            logger.warning("job %s sample %s skipped: %s", self.job_id, sample.sample_id, exc)
            return None
        record = {name: _truncate(name, tensor, max_length) for name, tensor in record.items()}
        with self._lock:
            stats.samples_loaded += 1
            stats.tokens_loaded += record["input_ids"].numel()
        return record

    def _verified_record(self, sample: ManifestSample) -> dict[str, torch.Tensor]:
        if self.decoded is not None and (record := self.decoded.get(sample.sha256)) is not None:
            return record
        record = self._read_record(sample)
        if self.decoded is not None:
            self.decoded.put(sample.sha256, record)
        return record

    def _read_record(self, sample: ManifestSample) -> dict[str, torch.Tensor]:
        data = self.cache.get(sample.sha256, sample.bytes) if self.cache else None
        if data is not None:
            return decode_verified(data, sample, self.hidden_size)
        if self._readers is not None:
            cache_dir = str(self.cache.directory) if self.cache else None
            read = self._readers.submit(read_in_process, sample, self.hidden_size, cache_dir).result()
            if read.skipped is not None:
                raise SkippedSample(sample.key, *read.skipped)
            if self.cache and read.cached_copy is not None:
                self.cache.adopt(sample.sha256, Path(read.cached_copy), sample.bytes)
            assert read.record is not None  # a read either skipped the sample or decoded it
            return read.record
        data = fetch_verified(self.storage, sample)
        if self.cache:
            self.cache.put(sample.sha256, data)
        return decode_verified(data, sample, self.hidden_size)


def fetch_verified(storage: Storage, sample: ManifestSample) -> bytes:
    """The sample's file, checked against its manifest entry (size, sha256)."""
    try:
        data = _retry(lambda: storage.get(sample.key), sample.key)
    except ObjectNotFound:
        raise SkippedSample(sample.key, "missing", "not in storage") from None
    if len(data) != sample.bytes:
        raise SkippedSample(sample.key, "size", f"{len(data)} bytes, manifest says {sample.bytes}")
    digest = hashlib.sha256(data).hexdigest()
    if digest != sample.sha256:
        raise SkippedSample(sample.key, "sha256", f"{digest}, manifest says {sample.sha256}")
    return data


def decode_verified(data: bytes, sample: ManifestSample, hidden_size: int) -> dict[str, torch.Tensor]:
    """The fields a batch needs of a verified file, each of the shape and dtype its manifest entry implies."""
    try:
        record = decode_sample(data)
    except (InvalidCapture, pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:
        raise SkippedSample(sample.key, "decode", str(exc)) from None
    length, width = sample.num_tokens, hidden_size
    expected = {
        "input_ids": ((length,), torch.long),
        "loss_mask": ((length,), torch.long),
        "aux_hidden_state": ((1, length, NUM_AUX_LAYERS * width), HIDDEN_DTYPE),
        "hidden_state": ((1, length, width), HIDDEN_DTYPE),
    }
    for name, (shape, dtype) in expected.items():
        tensor = record[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise SkippedSample(
                sample.key,
                "shape",
                f"{name} is {tensor.dtype} {list(tensor.shape)}, expected {dtype} {list(shape)}",
            )
    return {name: record[name] for name in expected}


@functools.cache
def reading_context() -> multiprocessing.context.BaseContext:
    """Reading processes are forked from a server process that has imported this module (and torch) once: a loader
    made later starts its processes in milliseconds, not in the seconds a fresh interpreter takes to import torch, and
    none of them is forked from the training process (its threads, its CUDA context)."""
    context = torch.multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return context


# A reading process's storage client, opened once by `_open_reading_process` when the process starts.
_reading_storage: Storage | None = None


def _open_reading_process(storage: Storage) -> None:
    global _reading_storage
    _reading_storage = storage  # a copy of the trainer's (its settings and URL; its own HTTP connections)
    torch.set_num_threads(1)  # decoding is a copy: no thread pool of its own per process


@dataclass(frozen=True)
class ProcessRead:
    """What a reading process sends back for one sample: its decoded fields (in shared memory: torch's
    multiprocessing moves a tensor's storage there rather than through the pipe), or why it was skipped; and, with a
    cache, the verified copy it wrote under a temporary name for the trainer's cache to take."""

    record: dict[str, torch.Tensor] | None
    skipped: tuple[str, str] | None  # (reason, detail) of a SkippedSample
    cached_copy: str | None


def read_in_process(sample: ManifestSample, hidden_size: int, cache_dir: str | None) -> ProcessRead:
    """A sample read, verified and decoded in a reading process. An HTTP read of tens of megabytes in Python takes
    the GIL thousands of times (each received chunk); in the training process's threads it made the step beside it
    1.34x slower on an H200 host reading from S3 (docs/benchmarks.md)."""
    assert _reading_storage is not None  # set by the pool's initializer
    try:
        data = fetch_verified(_reading_storage, sample)
        record = decode_verified(data, sample, hidden_size)
    except SkippedSample as exc:
        return ProcessRead(record=None, skipped=(exc.reason, exc.detail), cached_copy=None)
    cached_copy = None
    if cache_dir is not None:
        written = Path(cache_dir) / f".tmp-{uuid.uuid4().hex}"
        written.write_bytes(data)
        cached_copy = str(written)
    return ProcessRead(record=record, skipped=None, cached_copy=cached_copy)


def _truncate(name: str, tensor: torch.Tensor, max_length: int) -> torch.Tensor:
    return tensor[:max_length] if name in ("input_ids", "loss_mask") else tensor[:, :max_length]


def collate(records: list[dict[str, torch.Tensor]], *, pin_memory: bool = False) -> Batch:
    """Right-pad samples of true length to B x T; attention_mask marks the real tokens. With `pin_memory` the batch
    is collated into page-locked memory, which a GPU copies from at full speed and without blocking the host."""
    # B samples, T = the longest, H the target hidden size
    lengths = [r["input_ids"].numel() for r in records]
    B, T = len(records), max(lengths)
    H = records[0]["hidden_state"].shape[-1]
    input_ids = torch.zeros(B, T, dtype=torch.long, pin_memory=pin_memory)
    loss_mask = torch.zeros(B, T, dtype=torch.long, pin_memory=pin_memory)
    aux_hidden_state = torch.zeros(B, T, NUM_AUX_LAYERS * H, dtype=HIDDEN_DTYPE, pin_memory=pin_memory)
    hidden_state = torch.zeros(B, T, H, dtype=HIDDEN_DTYPE, pin_memory=pin_memory)
    attention_mask = torch.zeros(B, T, dtype=torch.bool, pin_memory=pin_memory)
    for i, (record, length) in enumerate(zip(records, lengths, strict=True)):
        input_ids[i, :length] = record["input_ids"]
        loss_mask[i, :length] = record["loss_mask"]
        aux_hidden_state[i, :length] = record["aux_hidden_state"][0]  # [1, L, 3H] -> [L, 3H]
        hidden_state[i, :length] = record["hidden_state"][0]  # [1, L, H] -> [L, H]
        attention_mask[i, :length] = True
    return Batch(
        input_ids=input_ids,
        loss_mask=loss_mask,
        aux_hidden_state=aux_hidden_state,
        hidden_state=hidden_state,
        attention_mask=attention_mask,
    )


def _retry(read: Callable[[], bytes], key: str) -> bytes:
    for attempt in range(1, STORAGE_ATTEMPTS):
        try:
            return read()
        except StorageUnavailable as exc:
            logger.warning("storage read %s failed (attempt %d), retrying: %s", key, attempt, exc)
            time.sleep(2 ** (attempt - 1))
    return read()
