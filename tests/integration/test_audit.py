"""The audit kind against a real reference server, real Redis and real storage: a clean extraction job passes, and
a job with one sample corrupted after capture (its manifest rewritten to match, so only the recomputation can tell)
fails, naming that sample and its defect; each defect in an extraction job of its own.

`make faults` lists these tests as the stored data's rows of the fault table, each with its audit's verdict."""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import torch

from shared.errors import SubmitError
from shared.lifecycle import jobs, shards
from shared.lifecycle.kind import ShardContext
from shared.lifecycle.kinds import AUDIT, EXTRACT
from shared.lifecycle.kinds.audit import AuditReport, report_key
from shared.lifecycle.schemas import JobRecord, JobSpec, Manifest, ManifestSample
from shared.settings import Settings
from shared.storage import layout
from shared.storage.objects import ObjectDigest, Storage, open_storage
from shared.storage.sample_format import decode_sample, encode_sample
from tests.datasets import write_dataset


def settings_for(tmp_path: Path, model_dir: Path, redis_url: str, storage: Storage) -> Settings:
    return Settings(
        redis_url=redis_url, storage_url=storage.url, dataset_roots=[str(tmp_path)], model_roots=[model_dir.parent]
    )


def run_job(kind: object, job: JobRecord, storage: Storage, redis_url: str, url: str) -> None:
    ctx = ShardContext(storage, redis.Redis.from_url(redis_url), Settings(inference_url=url), worker="test")
    for shard in range(job.shards_total):
        assert shards.run_shard(kind, job.job_id, shard, ctx).status == "committed"  # type: ignore[arg-type]


def submit_extraction(
    dataset_url: str | None, model_path: str, storage: Storage, settings: Settings, redis_url: str
) -> JobRecord:
    """An extraction job of the tiny model in shards of about 200 tokens, its tasks left for `run_job`."""
    return jobs.submit(
        JobSpec(dataset_url=dataset_url, model_path=model_path, shard_token_budget=200),
        settings=settings,
        storage=storage,
        client=redis.Redis.from_url(redis_url),
        enqueue=lambda *task: None,
    )


@pytest.fixture
def extracted(tmp_path: Path, tiny_model_dir: Path, redis_url: str, reference_server_url: str) -> tuple:
    storage = open_storage((tmp_path / "store").as_uri())
    dataset, _ = write_dataset(tmp_path / "data.jsonl", with_bad_lines=False)
    settings = settings_for(tmp_path, tiny_model_dir, redis_url, storage)
    job = submit_extraction(str(dataset), str(tiny_model_dir), storage, settings, redis_url)
    run_job(EXTRACT, job, storage, redis_url, reference_server_url)
    return job, storage, settings


def audit(
    job: JobRecord, storage: Storage, settings: Settings, redis_url: str, url: str, **spec: object
) -> AuditReport:
    sent: list[tuple] = []
    audit_job = jobs.submit(
        JobSpec(kind="audit", source_job_id=job.job_id, audit_backend_url=url, **spec),
        settings=settings,
        storage=storage,
        client=redis.Redis.from_url(redis_url),
        enqueue=lambda *task: sent.append(task),
    )
    assert sent == [("audit", audit_job.job_id, k) for k in range(audit_job.shards_total)]  # one task a shard
    run_job(AUDIT, audit_job, storage, redis_url, url)
    report = AUDIT.last_report(storage, job.job_id)
    assert report is not None and report.audit_job_id == audit_job.job_id
    return report


def verdict_line(report: AuditReport) -> str:
    """An audit's verdict in one line: the job, what it checked and every failed sample with its reasons."""
    verdict = "passed" if report.passed else "FAILED"
    line = (
        f"audit of {report.source_job_id} {verdict}, {report.samples_checked} samples checked, "
        f"{report.samples_failed} failed"
    )
    return line + "".join(f"; {f.sample_id}: {' | '.join(f.reasons)}" for f in report.failures)


def committed_entry(storage: Storage, job: JobRecord, sample_index: int) -> tuple[str, Manifest, ManifestSample]:
    for key in storage.list(layout.manifests_prefix(job.job_id)):
        manifest = Manifest.model_validate_json(storage.get(key))
        for entry in manifest.samples:
            if entry.sample_index == sample_index:
                return key, manifest, entry
    raise AssertionError(f"no sample {sample_index}")


def rewrite_file(storage: Storage, job: JobRecord, sample_index: int, data: bytes) -> str:
    """Put `data` in a committed sample's place, its manifest entry rewritten to match (as if it had been wrong when
    it was captured, so that only a recomputation can tell); returns the sample id."""
    key, manifest, entry = committed_entry(storage, job, sample_index)
    storage.put(entry.key, data)
    digest = ObjectDigest.of(data)
    entry.bytes, entry.sha256 = digest.size_bytes, digest.sha256
    storage.put(key, manifest.model_dump_json().encode())
    return entry.sample_id


def rewrite(storage: Storage, job: JobRecord, sample_index: int, change) -> str:
    """Change a committed sample's tensors (`change(aux, final)`), its manifest rewritten to match."""
    _, _, entry = committed_entry(storage, job, sample_index)
    record = decode_sample(storage.get(entry.key))
    aux, final = change(record["aux_hidden_state"][0].clone(), record["hidden_state"][0].clone())
    data = encode_sample(record["input_ids"].tolist(), record["loss_mask"].tolist(), aux, final)
    return rewrite_file(storage, job, sample_index, data)


def test_a_clean_job_passes_with_every_sample_checked(
    extracted: tuple, redis_url: str, reference_server_url: str, record_property: Callable[[str, object], None]
) -> None:
    job, storage, settings = extracted
    report = audit(job, storage, settings, redis_url, reference_server_url, audit_fraction=1.0)
    record_property("audit", verdict_line(report))  # the fault table's note (tests/faults/report.py)
    assert report.passed and report.samples_checked == job.samples_total and report.samples_failed == 0
    assert [layer.name for layer in report.layers][-1] == "final"
    assert all(layer.worst is not None and layer.worst <= 0.05 for layer in report.layers)
    # each extraction manifest names the server that captured; the report compares it with the one that recomputed
    assert report.source_backend["backend"] == report.backend["backend"] == "reference"
    assert report.independent is False


@dataclass
class Corruption:
    """One committed sample made wrong, and what the audit must say about it."""

    sample_id: str
    expected_reason: str


def zero_a_layer(job: JobRecord, storage: Storage, extract_again: Callable[[], JobRecord]) -> Corruption:
    """Sample 1's middle aux slice zeroed (a capture hook that wrote nothing)."""
    hidden = job.hidden_size

    def zero_middle_layer(aux: torch.Tensor, final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        aux[:, hidden : 2 * hidden] = 0
        return aux, final

    sample_id = rewrite(storage, job, 1, zero_middle_layer)
    return Corruption(sample_id, f"aux layer 1 (model layer {job.aux_layer_ids[1]}): relative error 1.000")


def swap_two_layers(job: JobRecord, storage: Storage, extract_again: Callable[[], JobRecord]) -> Corruption:
    """Sample 2's first two aux slices traded places (a layer-order mix-up)."""
    hidden = job.hidden_size

    def swap_low_layers(aux: torch.Tensor, final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        low, middle = aux[:, :hidden].clone(), aux[:, hidden : 2 * hidden].clone()
        aux[:, :hidden], aux[:, hidden : 2 * hidden] = middle, low
        return aux, final

    sample_id = rewrite(storage, job, 2, swap_low_layers)
    low, middle = job.aux_layer_ids[:2]
    return Corruption(sample_id, f"aux slices 0 and 1 (model layers {low} and {middle}) are swapped")


def take_another_samples_final_state(
    job: JobRecord, storage: Storage, extract_again: Callable[[], JobRecord]
) -> Corruption:
    """Sample 3's final state taken from sample 0 (states of one request saved under another)."""
    _, _, first_entry = committed_entry(storage, job, 0)
    other = decode_sample(storage.get(first_entry.key))

    def another_samples_final(aux: torch.Tensor, final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        length = min(final.shape[0], other["hidden_state"].shape[1])
        final[1:length] = other["hidden_state"][0, 1:length]  # the first token's state is the same in every sample
        return aux, final

    return Corruption(rewrite(storage, job, 3, another_samples_final), "final state: relative error")


def put_another_jobs_sample_in_place(
    job: JobRecord, storage: Storage, extract_again: Callable[[], JobRecord]
) -> Corruption:
    """Sample 4's file replaced by a whole sample file of another job (the same dataset extracted again, so its
    sample 0: a different conversation, self-consistent, in sample 4's place)."""
    other_job = extract_again()
    other_entry = Manifest.model_validate_json(storage.get(layout.manifest(other_job.job_id, 0))).samples[0]
    other_file = storage.get(other_entry.key)
    planned_length = committed_entry(storage, job, 4)[2].num_tokens
    sample_id = rewrite_file(storage, job, 4, other_file)
    if other_entry.num_tokens != planned_length:
        return Corruption(
            sample_id,
            f"length: the recomputed input ids are {planned_length}, the stored ones {other_entry.num_tokens}",
        )
    return Corruption(sample_id, "input ids: ")


@pytest.mark.parametrize(
    "corrupt",
    [
        pytest.param(zero_a_layer, id="zeroed-layer"),
        pytest.param(swap_two_layers, id="swapped-layers"),
        pytest.param(take_another_samples_final_state, id="another-samples-final"),
        pytest.param(put_another_jobs_sample_in_place, id="another-jobs-sample"),
    ],
)
def test_corrupted_samples_are_flagged_by_sample_and_defect(
    corrupt: Callable[..., Corruption],
    extracted: tuple,
    redis_url: str,
    reference_server_url: str,
    record_property: Callable[[str, object], None],
) -> None:
    """Each defect in an extraction job of its own: the audit fails that job naming the one corrupted sample and its
    defect, and passes every other sample of it."""
    job, storage, settings = extracted

    def extract_again() -> JobRecord:
        other_job = submit_extraction(job.spec.dataset_url, job.model.path, storage, settings, redis_url)
        run_job(EXTRACT, other_job, storage, redis_url, reference_server_url)
        return other_job

    corruption = corrupt(job, storage, extract_again)
    report = audit(job, storage, settings, redis_url, reference_server_url, audit_fraction=1.0)
    record_property("audit", verdict_line(report))  # the fault table's note (tests/faults/report.py)

    assert not report.passed and report.samples_checked == job.samples_total and report.samples_failed == 1
    (failure,) = report.failures
    assert failure.sample_id == corruption.sample_id
    assert corruption.expected_reason in " | ".join(failure.reasons)


def test_a_file_changed_after_its_commit_is_flagged(
    extracted: tuple, redis_url: str, reference_server_url: str
) -> None:
    job, storage, settings = extracted
    entry = Manifest.model_validate_json(storage.get(layout.manifest(job.job_id, 0))).samples[0]
    storage.put(entry.key, storage.get(entry.key) + b"\0")
    report = audit(job, storage, settings, redis_url, reference_server_url, audit_samples=job.samples_total)
    (failure,) = report.failures
    assert failure.sample_id == entry.sample_id and "changed after its commit" in failure.reasons[0]


def test_the_selection_is_seeded_and_an_audit_names_a_real_extraction_job(
    extracted: tuple, redis_url: str, reference_server_url: str
) -> None:
    job, storage, settings = extracted
    chosen = []
    for seed in (7, 7, 8):
        report = audit(job, storage, settings, redis_url, reference_server_url, audit_samples=3, seed=seed)
        audit_job = jobs.load_job(storage, report.audit_job_id)
        inputs = [jobs.load_shard_input(storage, audit_job, k) for k in range(audit_job.shards_total)]
        chosen.append([item.sample_id for shard in inputs for item in shard.items])  # type: ignore[attr-defined]
        assert report.samples_checked == 3
    assert chosen[0] == chosen[1] != chosen[2]  # the same seed picks the same samples
    with pytest.raises(SubmitError, match="job-missing"):
        jobs.submit(
            JobSpec(kind="audit", source_job_id="job-missing"),
            settings=settings,
            storage=storage,
            client=redis.Redis.from_url(redis_url),
            enqueue=lambda *task: None,
        )


def test_a_resume_rewrites_a_report_an_earlier_audit_left_in_place(
    extracted: tuple, redis_url: str, reference_server_url: str
) -> None:
    """A second audit whose report write was lost (the source still holding the first audit's report) is not done: a
    resume sends its last shard again, whose task writes the report; with its own report in place there is nothing
    to resend."""
    job, storage, settings = extracted
    first = audit(job, storage, settings, redis_url, reference_server_url, audit_samples=2)
    second = audit(job, storage, settings, redis_url, reference_server_url, audit_samples=2, seed=1)
    second_job = jobs.load_job(storage, second.audit_job_id)
    client = redis.Redis.from_url(redis_url)
    assert AUDIT.after_resume(storage, client, second_job, []) == []
    storage.put(report_key(job.job_id), first.model_dump_json().encode())  # the second audit's write lost
    assert AUDIT.after_resume(storage, client, second_job, []) == [second_job.shards_total - 1]
    assert AUDIT.after_resume(storage, client, second_job, [0]) == []  # shards still to run write it when they end
