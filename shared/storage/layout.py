"""Storage keys of a job, under `{root}/{job_id}/` (docs/architecture.md, "Storage layout")."""

ROWS_PER_DIR = 2000


def job_json(job_id: str) -> str:
    return f"{job_id}/job.json"


def vocab_mapping(job_id: str) -> str:
    return f"{job_id}/vocab_mapping.pt"


def rejected(job_id: str) -> str:
    return f"{job_id}/rejected.jsonl"


def shard_input(job_id: str, shard_index: int) -> str:
    return f"{job_id}/inputs/shard_{shard_index:06d}.json"


def manifest(job_id: str, shard_index: int) -> str:
    return f"{job_id}/manifests/shard_{shard_index:06d}.json"


def manifests_prefix(job_id: str) -> str:
    return f"{job_id}/manifests/"


def dead_letter(job_id: str, shard_index: int) -> str:
    return f"{job_id}/dead_letter/shard_{shard_index:06d}.json"


def dead_letter_prefix(job_id: str) -> str:
    return f"{job_id}/dead_letter/"


def sample(job_id: str, sample_index: int) -> str:
    # SpecForge's offline layout, so its trainer can read our files.
    group = sample_index // ROWS_PER_DIR * ROWS_PER_DIR
    return f"{job_id}/rows_{group}-{group + ROWS_PER_DIR}/data_{sample_index}.pt"


def shard_index_from_manifest_key(key: str) -> int:
    return int(key.rsplit("shard_", 1)[1].removesuffix(".json"))


def shard_index_from_dead_letter_key(key: str) -> int:
    return int(key.rsplit("shard_", 1)[1].removesuffix(".json"))


def cancelled(job_id: str) -> str:
    """Written when the job is cancelled, so that a job recovered after Redis lost its state stays cancelled."""
    return f"{job_id}/cancelled"


# Storage's job index: one empty object per published job, outside every job's folder (a job id cannot start with
# "_"), so that the jobs can be found again when Redis has lost them (shared/lifecycle/recovery.py).
JOB_INDEX_PREFIX = "_jobs/"


def job_index_entry(job_id: str) -> str:
    return f"{JOB_INDEX_PREFIX}{job_id}"


# Regenerate jobs (docs/regeneration.md); job.json, rejected.jsonl, inputs/ and manifests/ as above.


def tokenizer_prefix(job_id: str) -> str:
    """The target's tokenizer files, saved at submit, so that workers render prompts with the same template."""
    return f"{job_id}/tokenizer/"


def conversation(job_id: str, sample_index: int) -> str:
    group = sample_index // ROWS_PER_DIR * ROWS_PER_DIR
    return f"{job_id}/conversations/rows_{group}-{group + ROWS_PER_DIR}/conv_{sample_index}.json"


def regenerated_shard(job_id: str, shard_index: int) -> str:
    return f"{job_id}/regenerated/shard_{shard_index:06d}.jsonl"


def regenerated_dataset(job_id: str) -> str:
    """The assembled output: OpenAI `messages` JSONL, one line per regenerated conversation, in input order."""
    return f"{job_id}/regenerated.jsonl"


def failed_conversations(job_id: str) -> str:
    return f"{job_id}/failed.jsonl"


def regeneration_summary(job_id: str) -> str:
    return f"{job_id}/regeneration.json"


def chained_job_id(job_id: str) -> str:
    """The id of the extraction job a regenerate job submits on its output: deterministic, so submitting is
    idempotent."""
    return f"{job_id}-extract"


# Trainer runs (services/trainer): checkpoints and curves of run RUN of a job.


def trainer_prefix(job_id: str) -> str:
    return f"{job_id}/trainer/"


def trainer_checkpoints(job_id: str, run_name: str) -> str:
    """A training run's checkpoints, with latest.json pointing at the newest and its curves.html."""
    return f"{job_id}/trainer/{run_name}/checkpoints/"


def trainer_checkpoint(job_id: str, run_name: str, step: int) -> str:
    return f"{trainer_checkpoints(job_id, run_name)}step_{step:08d}.pt"


def trainer_latest(job_id: str, run_name: str) -> str:
    return f"{trainer_checkpoints(job_id, run_name)}latest.json"


def trainer_curves(job_id: str, run_name: str) -> str:
    return f"{trainer_checkpoints(job_id, run_name)}curves.html"
