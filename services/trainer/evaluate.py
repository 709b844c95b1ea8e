"""How good is a drafter: simulated acceptance from TTT accuracies, and the real thing by speculative decoding.

- `simulated_acceptance_length`: sum over k of prod_{i<=k} acc_i (SpecForge's `eval/simulated_acc_len`), the
  expected number of drafted tokens accepted per verification if step accuracies were the acceptance rates. It
  leaves out the bonus token, so compare it with a measured acceptance length minus one.
- `evaluate_heldout`: per-position accuracy and loss of the TTT objective, averaged over tokens of held-out batches.
- `evaluate_checkpoint`: both of the above on the job's held-out shards, plus acceptance measured by speculative
  decoding (speculative.py) of held-out prompts, for the checkpoint's drafter and for an untrained one.
- `evaluate_prompt_files`: measured acceptance on any prompt set a user serves (`eagle3 eval --prompts-file`):
  every dataset format the pipeline reads, every assistant turn a prompt.
"""

import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from services.trainer.checkpoint import Checkpoint, drafter_from_checkpoint, load_checkpoint
from services.trainer.data import PlannedBatch, SampleLoader, ShardFollower, TargetSignature, plan_all
from services.trainer.drafter import Eagle3Drafter, TargetHead, build_drafter, read_target_config
from services.trainer.loss import Batch, ttt_loss
from services.trainer.speculative import AcceptanceResult, measure_acceptance
from shared.data.datasets import InvalidRecord, iter_dataset_file
from shared.data.tokenization import ChatTokenizer
from shared.data.vocab import VocabMapping
from shared.errors import ConfigurationError
from shared.lifecycle.jobs import load_job
from shared.provenance import check_same
from shared.settings import Settings
from shared.storage.objects import open_storage

logger = logging.getLogger(__name__)


def simulated_acceptance_length(step_accuracies: list[float]) -> float:
    """sum_k prod_{i<=k} acc_i over the unrolled steps."""
    total, running = 0.0, 1.0
    for accuracy in step_accuracies:
        running *= accuracy
        total += running
    return total


@torch.no_grad()
def evaluate_heldout(
    drafter: Eagle3Drafter, target_head: TargetHead, batches: Iterable[Batch], ttt_length: int
) -> dict:
    """TTT accuracy and loss per position over held-out batches, each weighted by its counted tokens."""
    was_training = drafter.training
    drafter.eval()
    device = drafter.fc.weight.device
    correct, loss_sum, tokens = [0.0] * ttt_length, [0.0] * ttt_length, [0] * ttt_length
    num_batches = 0
    for batch in batches:
        out = ttt_loss(drafter, target_head, batch.to(device), ttt_length=ttt_length)
        for i, (accuracy, loss, count) in enumerate(
            zip(out.step_accuracies, out.step_losses, out.step_num_tokens, strict=True)
        ):
            correct[i] += accuracy * count
            loss_sum[i] += loss * count
            tokens[i] += count
        num_batches += 1
    drafter.train(was_training)

    acc_per_position = [c / n if n else 0.0 for c, n in zip(correct, tokens, strict=True)]
    loss_per_position = [s / n if n else 0.0 for s, n in zip(loss_sum, tokens, strict=True)]
    result = {
        "acc_per_position": acc_per_position,
        "loss_per_position": loss_per_position,
        "simulated_acceptance_length": simulated_acceptance_length(acc_per_position),
        "num_tokens": tokens[0],
        "num_batches": num_batches,
    }
    logger.info(
        "held-out eval: batches=%d tokens=%d acc=%s simulated_acceptance_length=%.3f",
        num_batches,
        tokens[0],
        [round(a, 3) for a in acc_per_position],
        result["simulated_acceptance_length"],
    )
    return result


# ----------------------------------------------------------------------------------------------------------
# A saved checkpoint against an untrained drafter


def heldout_batches(loader: SampleLoader, planned: list[PlannedBatch], device: torch.device) -> Iterator[Batch]:
    for item in planned:
        batch = loader.load(item)
        if batch is not None:
            yield batch.to(device)


def heldout_prompts(batches: list[Batch], count: int) -> list[list[int]]:
    """Up to `count` distinct prompts: each held-out sample up to its first loss-masked token (the conversation
    before the first assistant reply)."""
    prompts: list[list[int]] = []
    for batch in batches:
        for input_ids, loss_mask, real in zip(batch.input_ids, batch.loss_mask, batch.attention_mask, strict=True):
            ids, mask = input_ids[real].tolist(), loss_mask[real].tolist()
            first = mask.index(1) if 1 in mask else 0
            if first > 0 and ids[:first] not in prompts:
                prompts.append(ids[:first])
            if len(prompts) == count:
                return prompts
    return prompts


def evaluate_checkpoint(
    ref: str,
    *,
    settings: Settings,
    job_id: str | None = None,
    model_path: str | None = None,
    num_prompts: int = 8,
    num_draft_tokens: int = 7,
    max_new_tokens: int = 64,
    max_batches: int | None = None,
) -> dict[str, Any]:
    """Held-out per-position accuracy, simulated acceptance length, and acceptance measured by greedy chain
    speculative decoding of the target, for the checkpoint's drafter and for an untrained one (same seed)."""
    storage = open_storage(settings.storage_url, settings)
    checkpoint = load_checkpoint(ref, storage)
    config = checkpoint.train_config
    target = Path(model_path or checkpoint.model_path)
    drafter, target_head = drafter_from_checkpoint(checkpoint, model_path=target)
    untrained = untrained_drafter(checkpoint, target)
    job = load_job(storage, job_id or checkpoint.job_id)
    if checkpoint.provenance is not None and job.provenance is not None:
        check_same(job.provenance, checkpoint.provenance, what=f"evaluating {checkpoint.source} on job {job.job_id}")
    expected = TargetSignature.from_model_config(read_target_config(target), drafter.config.aux_layer_ids)
    follower = ShardFollower(job, storage=storage, expected=expected, heldout_fraction=config.heldout_fraction)
    follower.poll(block=False)
    manifests = follower.heldout_manifests()
    if not manifests:
        raise ConfigurationError(f"job {job.job_id}: no committed held-out shard to evaluate on")
    planned = plan_all(manifests, batch_tokens=config.batch_tokens, max_length=config.max_length)
    loader = SampleLoader(storage, job_id=job.job_id, hidden_size=expected.hidden_size)
    try:
        batches = list(
            heldout_batches(loader, planned[: max_batches or config.heldout_max_batches], torch.device("cpu"))
        )
    finally:
        loader.close()
    trained_heldout = evaluate_heldout(drafter, target_head, batches, config.ttt_length)
    untrained_heldout = evaluate_heldout(untrained, target_head, batches, config.ttt_length)

    prompts = heldout_prompts(batches, num_prompts)
    target_model = load_target(target)
    measured = measure_acceptance(
        target_model, drafter, prompts, num_draft_tokens=num_draft_tokens, max_new_tokens=max_new_tokens
    )
    baseline = measure_acceptance(
        target_model, untrained, prompts, num_draft_tokens=num_draft_tokens, max_new_tokens=max_new_tokens
    )
    return {
        "checkpoint": checkpoint.source,
        "job_id": job.job_id,
        "step": checkpoint.step,
        "train_tokens": checkpoint.train_tokens,
        "train_seconds": checkpoint.train_seconds,
        "acc_per_position": trained_heldout["acc_per_position"],
        "simulated_acceptance_length": trained_heldout["simulated_acceptance_length"],
        "untrained_acc_per_position": untrained_heldout["acc_per_position"],
        "untrained_simulated_acceptance_length": untrained_heldout["simulated_acceptance_length"],
        "measured_acceptance_length": measured.mean_accepted_per_step,
        "untrained_measured_acceptance_length": baseline.mean_accepted_per_step,
        "matches_greedy": measured.matches_greedy and baseline.matches_greedy,
        "num_prompts": len(prompts),
        "num_draft_tokens": num_draft_tokens,
        "heldout": trained_heldout,
        "untrained_heldout": untrained_heldout,
        "acceptance": asdict(measured),
        "untrained_acceptance": asdict(baseline),
    }


def untrained_drafter(checkpoint: Checkpoint, target: Path) -> Eagle3Drafter:
    """The drafter the checkpoint's run started from: same seed, same warm start from the target, same vocab."""
    return warm_start_drafter(
        target,
        checkpoint.vocab_mapping,
        aux_layer_ids=checkpoint.drafter_config.aux_layer_ids,
        seed=checkpoint.train_config.seed,
        init_from_target=checkpoint.train_config.init_from_target,
    )


def warm_start_drafter(
    target: Path, vocab_mapping: VocabMapping, *, aux_layer_ids: list[int], seed: int, init_from_target: bool = True
) -> Eagle3Drafter:
    """A drafter as a training run starts it (its seed, the warm start from the target): the untrained yardstick."""
    torch.manual_seed(seed)
    drafter, _ = build_drafter(target, vocab_mapping, aux_layer_ids=aux_layer_ids, init_from_target=init_from_target)
    return drafter


def load_target(target: Path) -> Any:
    """The target in float32, so that speculative and plain greedy decoding round alike (see measure_acceptance)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)


# ----------------------------------------------------------------------------------------------------------
# Measured acceptance on prompt files


def prompts_from_file(path: Path, chat: ChatTokenizer, *, max_prompts: int | None = None) -> list[list[int]]:
    """Token ids of every prompt in a dataset file, in file order: each assistant turn of a conversation gives the
    conversation before it, rendered with the target's chat template and its generation prompt (what the target
    reads before it writes that turn). A preformatted `text` record is one prompt, as written. A record that the
    pipeline would reject stops the evaluation with its line and reason."""
    if not path.is_file():
        raise ConfigurationError(f"prompts file {path}: no such file")
    prompts: list[list[int]] = []
    for record in iter_dataset_file(path):
        if isinstance(record, InvalidRecord):
            raise ConfigurationError(f"prompts file {path}, line {record.line}: {record}")
        if record.text is not None:
            prompts.append(chat.tokenizer(record.text, add_special_tokens=False)["input_ids"])
        else:
            for index, message in enumerate(record.messages):
                if message.role == "assistant":
                    prompts.append(chat.generation_prompt(record, record.messages[:index]))
        if max_prompts is not None and len(prompts) >= max_prompts:
            return prompts[:max_prompts]
    if not prompts:
        raise ConfigurationError(f"prompts file {path}: no prompt in it")
    return prompts


@dataclass
class PromptFileResult:
    """One drafter on one prompt file: the numbers `eagle3 eval --prompts-file` prints."""

    file: str
    drafter: str  # "trained" (the checkpoint's) or "untrained" (its warm start, --baseline)
    prompts: int
    new_tokens: int
    acceptance_length: float  # mean over prompts of tokens per verification step, the bonus token included
    acceptance_length_ci95: tuple[float, float]  # 95% interval of that mean over prompts
    pooled_acceptance_length: float  # all new tokens over all verification steps
    position_acceptance: list[float]  # share of verification steps whose draft k+1 was accepted
    matches_greedy: bool | None  # every output equals plain greedy decoding of the target (None: not checked)
    wall_s: float  # speculative decoding and the greedy check, for this file and drafter

    @classmethod
    def from_acceptance(cls, file: str, drafter: str, result: AcceptanceResult, wall_s: float) -> "PromptFileResult":
        return cls(
            file=file,
            drafter=drafter,
            prompts=result.prompts,
            new_tokens=result.tokens,
            acceptance_length=result.mean_acceptance_length,
            acceptance_length_ci95=result.acceptance_length_ci95,
            pooled_acceptance_length=result.mean_accepted_per_step,
            position_acceptance=result.position_acceptance,
            matches_greedy=result.matches_greedy,
            wall_s=wall_s,
        )


def evaluate_prompt_files(
    ref: str,
    files: list[Path],
    *,
    settings: Settings,
    model_path: str | None = None,
    baseline: bool = False,
    max_prompts: int | None = None,
    num_draft_tokens: int = 7,
    max_new_tokens: int = 64,
) -> dict[str, Any]:
    """Measured acceptance of a checkpoint's drafter on each prompt file (and of its untrained start with
    `baseline`), decoding with the target it was trained against."""
    storage = open_storage(settings.storage_url, settings)
    checkpoint = load_checkpoint(ref, storage)
    target = Path(model_path or checkpoint.model_path)
    drafters = {"trained": drafter_from_checkpoint(checkpoint, model_path=target)[0]}
    if baseline:
        drafters["untrained"] = untrained_drafter(checkpoint, target)
    chat = ChatTokenizer.from_pretrained(target)
    prompt_sets = {str(path): prompts_from_file(path, chat, max_prompts=max_prompts) for path in files}
    target_model = load_target(target)
    results = []
    for file, prompts in prompt_sets.items():
        for name, drafter in drafters.items():
            started = time.perf_counter()
            acceptance = measure_acceptance(
                target_model, drafter, prompts, num_draft_tokens=num_draft_tokens, max_new_tokens=max_new_tokens
            )
            wall_s = time.perf_counter() - started
            results.append(PromptFileResult.from_acceptance(file, name, acceptance, wall_s))
            logger.info("%s on %s: acceptance length %.3f", name, file, results[-1].acceptance_length)
    return {
        "checkpoint": checkpoint.source,
        "job_id": checkpoint.job_id,
        "step": checkpoint.step,
        "num_draft_tokens": num_draft_tokens,
        "max_new_tokens": max_new_tokens,
        "results": [asdict(result) for result in results],
    }


def acceptance_table(report: dict[str, Any]) -> Table:
    """The report of `evaluate_prompt_files` as one table: a row per file and drafter."""
    table = Table(
        title=f"measured acceptance: {report['checkpoint']} (step {report['step']}), "
        f"{report['num_draft_tokens']} draft tokens, up to {report['max_new_tokens']} new tokens per prompt"
    )
    for column in ("prompts file", "drafter", "prompts", "new tokens", "accept length", "95% interval"):
        table.add_column(column, justify="left" if column in ("prompts file", "drafter") else "right", overflow="fold")
    table.add_column("acceptance per draft position")
    table.add_column("matches greedy")
    table.add_column("wall s", justify="right")
    files = {row["file"] for row in report["results"]}
    # A folder path makes the table unreadable in a terminal; the file name says it when the names differ.
    short_names = len({Path(file).name for file in files}) == len(files)
    for row in report["results"]:
        low, high = row["acceptance_length_ci95"]
        table.add_row(
            Path(row["file"]).name if short_names else row["file"],
            row["drafter"],
            str(row["prompts"]),
            str(row["new_tokens"]),
            f"{row['acceptance_length']:.3f}",
            f"{low:.3f}-{high:.3f}",
            " ".join(f"{share:.2f}" for share in row["position_acceptance"]),
            {True: "yes", False: "NO", None: "-"}[row["matches_greedy"]],
            f"{row['wall_s']:.1f}",
        )
    return table
