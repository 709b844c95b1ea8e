"""Trainer data: committed shards from manifests and from the real Redis event stream, the held-out split,
refusals, verification and skipping, the cache, token-budget batching and resumable positions."""

import json
import threading
import time
from pathlib import Path

import pytest
import redis
import torch
from prometheus_client import REGISTRY

from services.trainer.data import (
    NOT_READY,
    BatchPlanner,
    DataPosition,
    DecodedSampleCache,
    IncompatibleJob,
    PlannedBatch,
    SampleCache,
    SampleLoader,
    ShardFollower,
    TargetSignature,
    collate,
    heldout_shards,
    plan_all,
)
from services.trainer.loss import with_token_embeds
from shared.lifecycle.schemas import JobRecord, Manifest, ManifestSample
from shared.storage import layout
from shared.storage.objects import Storage, open_storage
from tests.trainer.shard_builders import commit_random_shard, dead_letter_shard, plan_job


@pytest.fixture
def storage(tmp_path: Path) -> Storage:
    return open_storage((tmp_path / "store").as_uri())


@pytest.fixture
def job(tmp_path: Path, tiny_model_dir: Path, redis_url: str, storage: Storage) -> JobRecord:
    """17 samples in about 10 shards, planned, nothing committed yet."""
    return plan_job(tmp_path, tiny_model_dir, redis_url, storage, shard_token_budget=60)


def signature(job: JobRecord, **changes: object) -> TargetSignature:
    values = {
        "aux_layer_ids": tuple(job.aux_layer_ids),
        "hidden_size": job.hidden_size,
        "num_hidden_layers": job.model.num_hidden_layers,
        "architecture": job.model.architecture,
        **changes,
    }
    return TargetSignature(**values)  # type: ignore[arg-type]


def drain(planner: BatchPlanner) -> list[PlannedBatch]:
    batches = []
    while (batch := planner.next_batch()) is not None:
        if batch != NOT_READY:
            batches.append(batch)
    return batches


def test_committed_shards_are_recovered_from_manifests(job: JobRecord, storage: Storage, redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    committed = [commit_random_shard(storage, client, job, k) for k in range(job.shards_total)]
    client.flushdb()  # recovery needs storage only: the manifests are the truth
    follower = ShardFollower(job, storage=storage, expected=signature(job), heldout_fraction=0.2)
    training = follower.poll()
    assert training is not None
    assert {m.shard_index for m in training} == {m.shard_index for m in committed} - follower.heldout
    assert [m.shard_index for m in follower.heldout_manifests()] == sorted(follower.heldout)
    assert follower.poll() is None
    again = ShardFollower(job, storage=storage, expected=signature(job), heldout_fraction=0.2).poll()  # a restart
    assert again == training


def test_follow_takes_shards_committed_after_start_and_ends_with_the_job(
    job: JobRecord, storage: Storage, redis_url: str
) -> None:
    client = redis.Redis.from_url(redis_url)
    assert job.shards_total >= 6, job.shards_total
    commit_random_shard(storage, client, job, 0)
    follower = ShardFollower(
        job,
        storage=storage,
        expected=signature(job),
        redis_client=redis.Redis.from_url(redis_url),
        follow=True,
        heldout_fraction=0.2,
        block_s=0.2,
    )
    planner = BatchPlanner(follower, batch_tokens=256, max_length=256, epochs=1, position=DataPosition(seed=0))
    planned: list[PlannedBatch] = []
    not_ready = 0
    finished_at: list[float] = []

    def consume() -> None:
        nonlocal not_ready
        while (batch := planner.next_batch()) is not None:
            if batch == NOT_READY:
                not_ready += 1
            else:
                planned.append(batch)
        finished_at.append(time.monotonic())

    consumer = threading.Thread(target=consume)
    consumer.start()
    for k in range(1, job.shards_total - 1):
        time.sleep(0.1)
        commit_random_shard(storage, client, job, k)
    time.sleep(0.5)
    assert consumer.is_alive(), "the follower stopped before the job finished"
    last_commit = time.monotonic()
    dead_letter_shard(storage, client, job, job.shards_total - 1)  # the job is now finished, with an error
    consumer.join(timeout=30)
    assert not consumer.is_alive()

    assert finished_at[0] >= last_commit
    assert not_ready > 0  # it waited on the stream for shards that were not committed yet
    expected_keys = {
        s.key for k, m in follower.manifests.items() if k not in follower.heldout for s in m.samples if s.loss_tokens
    }
    assert sorted(s.key for b in planned for s in b.samples) == sorted(expected_keys)
    assert set(follower.manifests) == set(range(job.shards_total - 1))
    assert follower.dead_lettered == {job.shards_total - 1}
    assert follower.mark is not None
    follower.mark.stop()  # as the trainer does once it has read the job (its refresh thread would outlive the test)


def test_heldout_shards_never_train(job: JobRecord, storage: Storage, redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    for k in range(job.shards_total):
        commit_random_shard(storage, client, job, k)
    follower = ShardFollower(job, storage=storage, expected=signature(job), heldout_fraction=0.25)
    assert len(follower.heldout) == -(-job.shards_total // 4)
    planner = BatchPlanner(follower, batch_tokens=128, max_length=128, epochs=3, position=DataPosition(seed=1))
    trained = {s.key for b in drain(planner) for s in b.samples}
    heldout = {s.key for m in follower.heldout_manifests() for s in m.samples}
    assert heldout and trained and not trained & heldout


def test_heldout_split_is_fixed_by_shard_index() -> None:
    assert heldout_shards(1, 0.5) == frozenset()
    assert len(heldout_shards(2, 0.01)) == 1  # at least one shard when there are two
    assert len(heldout_shards(3, 0.99)) == 2  # never all of them
    assert heldout_shards(100, 0.05) == heldout_shards(100, 0.05)
    assert len(heldout_shards(100, 0.05)) == 5
    assert heldout_shards(100, 0.0) == frozenset()


@pytest.mark.parametrize(
    ("changes", "field", "found", "expected"),
    [
        pytest.param({"aux_layer_ids": (1, 3, 5)}, "aux_layer_ids", "[1, 3, 4]", "[1, 3, 5]", id="layer-ids"),
        pytest.param({"hidden_size": 128}, "hidden_size", "64", "128", id="hidden-size"),
        pytest.param({"num_hidden_layers": 12}, "num_hidden_layers", "8", "12", id="target-model"),
    ],
)
def test_job_for_another_target_is_refused(
    job: JobRecord, storage: Storage, changes: dict, field: str, found: str, expected: str
) -> None:
    with pytest.raises(IncompatibleJob) as info:
        ShardFollower(job, storage=storage, expected=signature(job, **changes))
    message = str(info.value)
    assert job.job_id in message and "job.json" in message
    assert f"{field} is {found}, but the trainer was started for {expected}" in message


def test_shard_with_other_layer_ids_than_its_job_is_refused(job: JobRecord, storage: Storage, redis_url: str) -> None:
    manifest = commit_random_shard(storage, redis.Redis.from_url(redis_url), job, 0)
    storage.put(
        layout.manifest(job.job_id, 1),
        manifest.model_copy(update={"shard_index": 1, "aux_layer_ids": [1, 2, 3]}).model_dump_json().encode(),
    )
    follower = ShardFollower(job, storage=storage, expected=signature(job), heldout_fraction=0)
    with pytest.raises(IncompatibleJob, match=r"manifests/shard_000001.json: aux_layer_ids is \[1, 2, 3\]"):
        follower.poll()


# The loader reads in its own threads, or in reading processes (what it reads from S3 by default): the same checks,
# the same batches.
READ_PROCESSES = [pytest.param(0, id="threads"), pytest.param(2, id="processes")]


@pytest.mark.parametrize("read_processes", READ_PROCESSES)
def test_missing_and_corrupted_objects_are_skipped_and_counted(
    job: JobRecord, storage: Storage, redis_url: str, read_processes: int
) -> None:
    client = redis.Redis.from_url(redis_url)
    manifests = [commit_random_shard(storage, client, job, k) for k in range(job.shards_total)]
    samples = [s for m in manifests for s in m.samples if s.loss_tokens]
    corrupted, missing = samples[0], samples[1]
    data = bytearray(storage.get(corrupted.key))
    data[len(data) // 2] ^= 0xFF  # same size, different sha256
    storage.put(corrupted.key, bytes(data))
    storage.delete(missing.key)

    def skipped(reason: str) -> float:
        return (
            REGISTRY.get_sample_value("eagle3_trainer_skipped_samples_total", {"job_id": job.job_id, "reason": reason})
            or 0.0
        )

    before = {reason: skipped(reason) for reason in ("sha256", "missing")}
    loader = SampleLoader(
        storage, job_id=job.job_id, hidden_size=job.hidden_size, cache=None, io_threads=2, read_processes=read_processes
    )
    batches = [loader.load(b) for b in plan_all(manifests, batch_tokens=512, max_length=512)]
    loader.close()
    assert sum(b.input_ids.shape[0] for b in batches if b is not None) == len(samples) - 2
    assert loader.stats.skipped == {"sha256": 1, "missing": 1}
    assert loader.stats.as_dict()["skipped_samples"] == 2
    assert skipped("sha256") == before["sha256"] + 1 and skipped("missing") == before["missing"] + 1


def test_batches_are_verified_right_padded_samples(job: JobRecord, storage: Storage, redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    manifests = [commit_random_shard(storage, client, job, k) for k in range(3)]
    embedding = torch.randn(1000, 16)  # the trainer's loader is given the drafter's token embedding, on the host
    loader = SampleLoader(storage, job_id=job.job_id, hidden_size=job.hidden_size, token_embedding=embedding)
    planned = plan_all(manifests, batch_tokens=256, max_length=256)[0]
    batch = loader.load(planned)
    loader.close()
    assert batch is not None
    B, T = batch.input_ids.shape
    assert (len(planned.samples), planned.length) == (B, T)
    assert batch.token_embeds is not None and torch.equal(batch.token_embeds, embedding[batch.input_ids])
    assert batch.aux_hidden_state.shape == (B, T, 3 * job.hidden_size)
    assert batch.hidden_state.shape == (B, T, job.hidden_size)
    for row, sample in enumerate(planned.samples):
        length = sample.num_tokens
        assert batch.attention_mask[row].sum() == length and batch.attention_mask[row, :length].all()
        assert not batch.loss_mask[row, length:].any() and not batch.hidden_state[row, length:].any()
        assert batch.loss_mask[row].sum() == sample.loss_tokens


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked memory needs a CUDA device")
def test_cuda_batches_collate_into_page_locked_memory_and_reach_the_gpu_unchanged() -> None:
    """On a GPU the trainer's loader collates into page-locked memory (and looks the embeddings up into it), and the
    step copies the batch without blocking: the same tensors arrive as from a plain batch's blocking copy."""
    generator = torch.Generator().manual_seed(0)
    H = 16
    records = [
        {
            "input_ids": torch.randint(0, 1000, (length,), generator=generator),
            "loss_mask": torch.randint(0, 2, (length,), generator=generator),
            "aux_hidden_state": torch.randn(1, length, 3 * H, generator=generator).to(torch.bfloat16),
            "hidden_state": torch.randn(1, length, H, generator=generator).to(torch.bfloat16),
        }
        for length in (7, 12, 9)
    ]
    embedding = torch.randn(1000, H, generator=generator).to(torch.bfloat16)
    plain = with_token_embeds(collate(records), embedding)
    pinned = with_token_embeds(collate(records, pin_memory=True), embedding)
    on_gpu = pinned.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    for name, tensor in vars(plain).items():
        assert getattr(pinned, name).is_pinned(), name
        assert torch.equal(getattr(on_gpu, name).cpu(), tensor), name


def _manifest(shard_index: int, lengths: list[int]) -> Manifest:
    samples = [
        ManifestSample(
            sample_index=shard_index * 100 + i,
            sample_id=f"s{shard_index}-{i}",
            key=f"j/rows_0-2000/data_{shard_index * 100 + i}.pt",
            num_tokens=n,
            loss_tokens=n // 2,
            bytes=1,
            sha256="0",
        )
        for i, n in enumerate(lengths)
    ]
    return Manifest(
        job_id="j",
        shard_index=shard_index,
        aux_layer_ids=[1, 3, 4],
        hidden_size=64,
        dtype="bfloat16",
        samples=samples,
        num_samples=len(samples),
        num_tokens=sum(lengths),
        loss_tokens=0,
        bytes=0,
        worker="w",
        started_at="",
        committed_at="",
        timings_s={},
    )


class ListSource:
    def __init__(self, manifests: list[Manifest]) -> None:
        self.answers: list[list[Manifest] | None] = [manifests, None]

    def poll(self, *, block: bool) -> list[Manifest] | None:
        return self.answers.pop(0) if self.answers else None


def test_batches_fit_the_token_budget_and_cover_every_sample_each_epoch() -> None:
    generator = torch.Generator().manual_seed(0)
    manifests = [_manifest(k, torch.randint(3, 90, (15,), generator=generator).tolist()) for k in range(8)]
    manifests.append(_manifest(8, [300]))  # longer than max_length: truncated, still trained on
    planner = BatchPlanner(
        ListSource(manifests), batch_tokens=200, max_length=120, epochs=2, position=DataPosition(seed=3)
    )
    batches = drain(planner)
    assert all(len(b.samples) * b.length <= 200 for b in batches)
    assert all(b.length == max(min(s.num_tokens, 120) for s in b.samples) for b in batches)
    keys = [s.key for b in batches for s in b.samples]
    every = sorted(s.key for m in manifests for s in m.samples)
    assert sorted(keys) == sorted(every * 2)
    first_epoch = [s.key for b in batches[: len(batches) // 2] for s in b.samples]
    assert first_epoch != keys[len(keys) // 2 :]  # the second epoch is in another order
    padded = sum(len(b.samples) * b.length for b in batches)
    real = sum(b.num_tokens for b in batches)
    assert real / padded > 0.8  # length-sorted packing pads little


def test_a_restored_position_replays_the_same_batches() -> None:
    generator = torch.Generator().manual_seed(1)
    manifests = [_manifest(k, torch.randint(3, 60, (12,), generator=generator).tolist()) for k in range(10)]

    def planner(position: DataPosition) -> BatchPlanner:
        return BatchPlanner(
            ListSource(manifests), batch_tokens=150, max_length=150, epochs=3, position=position, pool_tokens=600
        )

    uninterrupted = drain(planner(DataPosition(seed=7)))
    for stop in (1, 7, len(uninterrupted) // 2, len(uninterrupted) - 1):
        first = planner(DataPosition(seed=7))
        for _ in range(stop):
            first.next_batch()
        saved = json.loads(first.position.model_dump_json())  # as a checkpoint stores it
        assert drain(planner(DataPosition.model_validate(saved))) == uninterrupted[stop:]


def test_cache_evicts_least_recently_used_under_its_budget(tmp_path: Path) -> None:
    cache = SampleCache(tmp_path / "cache", budget_bytes=250)
    for name in ("a", "b"):
        cache.put(name, name.encode() * 100)
    assert cache.get("a", 100) == b"a" * 100  # a is now the most recently used
    cache.put("c", b"c" * 100)
    assert cache.get("b", 100) is None and cache.get("a", 100) is not None and cache.get("c", 100) is not None
    assert cache.used_bytes == 200 <= cache.budget_bytes
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["a", "c"]
    cache.put("big", b"x" * 300)  # larger than the whole budget: not cached, nothing evicted
    assert cache.get("big", 300) is None and cache.used_bytes == 200
    restarted = SampleCache(tmp_path / "cache", budget_bytes=150)  # a smaller budget after a restart
    assert restarted.used_bytes == 100 and restarted.get("c", 100) is not None  # c was used last


@pytest.mark.parametrize("read_processes", READ_PROCESSES)
def test_loader_serves_verified_samples_from_its_cache(
    job: JobRecord, storage: Storage, redis_url: str, tmp_path: Path, read_processes: int
) -> None:
    manifest = commit_random_shard(storage, redis.Redis.from_url(redis_url), job, 0)
    cache = SampleCache(tmp_path / "cache", budget_bytes=10**9)
    loader = SampleLoader(
        storage, job_id=job.job_id, hidden_size=job.hidden_size, cache=cache, read_processes=read_processes
    )
    planned = plan_all([manifest], batch_tokens=1024, max_length=1024)
    first = [loader.load(b) for b in planned]
    # every sample's verified copy is in the cache, under its sha256 (a reading process wrote it, the loader took it)
    cached = sorted(path.name for path in (tmp_path / "cache").iterdir())
    assert cached == sorted({sample.sha256 for sample in manifest.samples})
    assert cache.used_bytes == sum({sample.sha256: sample.bytes for sample in manifest.samples}.values())
    for sample in manifest.samples:
        storage.delete(sample.key)  # from now on only the cache has them
    again = [loader.load(b) for b in planned]
    loader.close()
    assert loader.stats.skipped == {}
    for a, b in zip(first, again, strict=True):
        assert a is not None and b is not None and torch.equal(a.hidden_state, b.hidden_state)


def test_decoded_cache_keeps_what_fits_and_evicts_nothing() -> None:
    cache = DecodedSampleCache(budget_bytes=250)
    record = {"hidden_state": torch.zeros(100, dtype=torch.uint8)}
    cache.put("a", record)
    cache.put("b", {"hidden_state": torch.zeros(100, dtype=torch.uint8)})
    cache.put("c", {"hidden_state": torch.zeros(100, dtype=torch.uint8)})  # past the budget: not kept
    assert cache.get("a") is record and cache.get("b") is not None and cache.get("c") is None
    assert (cache.used_bytes, cache.hits, cache.misses) == (200, 2, 1)


def test_later_epochs_are_served_from_memory(job: JobRecord, storage: Storage, redis_url: str) -> None:
    manifest = commit_random_shard(storage, redis.Redis.from_url(redis_url), job, 0)
    decoded = DecodedSampleCache(budget_bytes=10**9)
    loader = SampleLoader(storage, job_id=job.job_id, hidden_size=job.hidden_size, decoded=decoded)
    planned = plan_all([manifest], batch_tokens=1024, max_length=1024)
    first = [loader.load(b) for b in planned]
    for sample in manifest.samples:
        storage.delete(sample.key)  # from now on only memory has them
    again = [loader.load(b) for b in planned]
    loader.close()
    assert loader.stats.skipped == {} and decoded.hits == decoded.misses == len(manifest.samples)
    for a, b in zip(first, again, strict=True):
        assert a is not None and b is not None
        assert torch.equal(a.hidden_state, b.hidden_state) and torch.equal(a.aux_hidden_state, b.aux_hidden_state)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
