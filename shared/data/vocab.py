"""Token frequencies -> the drafter's reduced vocabulary (`d2t`, `t2d`), in SpecForge's layout.

The drafter predicts over the `draft_vocab_size` target tokens that are most often trained on
(loss-masked), so its lm_head is small; SGLang maps its predictions back with `d2t`.

  d2t: int64 [V_draft]   offset, target_id = draft_id + d2t[draft_id]
  t2d: bool  [V_target]  True where the target token is in the draft vocabulary

Draft ids are assigned in increasing target-id order, so `d2t` is non-decreasing and `t2d`
alone determines the mapping (draft id i is the i-th True entry of `t2d`).
"""

import io
import logging
import pickle
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from shared.errors import ConfigurationError, Eagle3Error

logger = logging.getLogger(__name__)


class VocabMappingError(Eagle3Error):
    """A stored vocab mapping that cannot be used; the message names the source, the field and the reason."""


class _LossMasked(Protocol):
    # Read-only: a frozen dataclass (TokenizedSample) has them too.
    @property
    def input_ids(self) -> list[int]: ...
    @property
    def loss_mask(self) -> list[int]: ...


@dataclass(frozen=True)
class VocabMapping:
    d2t: torch.Tensor  # int64 [V_draft]
    t2d: torch.Tensor  # bool  [V_target]
    coverage: float | None  # share of loss-masked tokens inside the draft vocab; None once loaded from bytes
    draft_vocab_size: int

    @property
    def target_ids(self) -> torch.Tensor:
        """int64 [V_draft]: the target id of each draft id."""
        return torch.arange(self.draft_vocab_size, dtype=torch.long) + self.d2t


def count_loss_tokens(samples: Iterable[_LossMasked]) -> Counter[int]:
    """How often each target token id is trained on (loss_mask == 1) over all samples."""
    counts: Counter[int] = Counter()
    for sample in samples:
        counts.update(token for token, masked in zip(sample.input_ids, sample.loss_mask, strict=True) if masked)
    return counts


def build_vocab_mapping(counts: Counter[int], *, target_vocab_size: int, draft_vocab_size: int) -> VocabMapping:
    """Draft vocab = the most frequent loss-masked target tokens (ties: lower id first).

    If fewer distinct tokens were seen than the draft vocab holds, the rest is filled with the
    lowest unused target ids, so the drafter's lm_head always has `draft_vocab_size` rows.
    """
    if target_vocab_size < 1 or draft_vocab_size < 1:
        raise ConfigurationError(
            f"vocab sizes must be positive: target_vocab_size={target_vocab_size} draft_vocab_size={draft_vocab_size}"
        )
    out_of_range = sorted(token for token in counts if not 0 <= token < target_vocab_size)
    if out_of_range:
        raise ConfigurationError(
            f"token ids {out_of_range[:5]} are outside the target vocab of {target_vocab_size} "
            "(tokenizer and target_vocab_size disagree)"
        )
    if draft_vocab_size > target_vocab_size:
        logger.info("draft_vocab_size=%d capped at target_vocab_size=%d", draft_vocab_size, target_vocab_size)
        draft_vocab_size = target_vocab_size

    ranked = sorted((token for token, count in counts.items() if count > 0), key=lambda token: (-counts[token], token))
    chosen = set(ranked[:draft_vocab_size])
    seen = len(chosen)
    filler = (token for token in range(target_vocab_size) if token not in chosen)
    while len(chosen) < draft_vocab_size:
        chosen.add(next(filler))

    target_ids = torch.tensor(sorted(chosen), dtype=torch.long)  # [V_draft], increasing
    d2t = target_ids - torch.arange(draft_vocab_size, dtype=torch.long)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[target_ids] = True

    total = sum(count for count in counts.values() if count > 0)
    covered = sum(counts[token] for token in ranked[:draft_vocab_size])
    coverage = covered / total if total else 0.0
    logger.info(
        "vocab mapping: draft=%d target=%d seen=%d distinct coverage=%.4f",
        draft_vocab_size,
        target_vocab_size,
        seen,
        coverage,
    )
    return VocabMapping(d2t=d2t, t2d=t2d, coverage=coverage, draft_vocab_size=draft_vocab_size)


def vocab_mapping_bytes(mapping: VocabMapping) -> bytes:
    """The `vocab_mapping.pt` file: torch.save of {"d2t", "t2d"}, as SpecForge and SGLang read it."""
    buffer = io.BytesIO()
    torch.save({"d2t": mapping.d2t, "t2d": mapping.t2d}, buffer)
    return buffer.getvalue()


def load_vocab_mapping(data: bytes, *, source: str = "vocab_mapping.pt") -> VocabMapping:
    """Load and check a `vocab_mapping.pt` (weights_only: the file may come from shared storage)."""
    try:
        loaded = torch.load(io.BytesIO(data), weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:
        raise VocabMappingError(f"{source}: not a torch.save file of tensors: {exc}") from exc
    if not isinstance(loaded, dict):
        raise VocabMappingError(f"{source}: expected a dict with 'd2t' and 't2d', got {type(loaded).__name__}")
    for key, dtype in (("d2t", torch.long), ("t2d", torch.bool)):
        tensor = loaded.get(key)
        if not isinstance(tensor, torch.Tensor):
            raise VocabMappingError(f"{source}: {key}: missing or not a tensor")
        if tensor.dtype != dtype or tensor.dim() != 1:
            raise VocabMappingError(
                f"{source}: {key}: expected {dtype} with 1 dimension, got {tensor.dtype} {list(tensor.shape)}"
            )
    d2t, t2d = loaded["d2t"], loaded["t2d"]
    draft_vocab_size = d2t.numel()
    if draft_vocab_size == 0 or int(t2d.sum()) != draft_vocab_size:
        raise VocabMappingError(
            f"{source}: t2d: {int(t2d.sum())} target tokens marked but d2t has {draft_vocab_size} draft tokens"
        )
    target_ids = torch.arange(draft_vocab_size, dtype=torch.long) + d2t
    if not torch.equal(target_ids, t2d.nonzero().flatten()):
        raise VocabMappingError(f"{source}: d2t: offsets do not point at the target ids that t2d marks, in order")
    return VocabMapping(d2t=d2t, t2d=t2d, coverage=None, draft_vocab_size=draft_vocab_size)
