"""What makes two jobs' hidden states comparable, recorded once at submit (job.json `provenance`).

Two sets of hidden states can be trained on together, or a run resumed onto new data, only if they came from the
same target (config and weights), were tokenized the same way (tokenizer and chat template), capture the same
layers the same way, are stored the same way, and index the same draft vocabulary. The trainer checks the record
before it trains, resumes or evaluates, and refuses with the first field that differs; every checkpoint and every
export carries the record of the data it was trained on.

Conventions written into the record rather than assumed:
- `aux_layer_convention`: aux layer id i is the output of 0-indexed decoder layer i, Hugging Face
  `output_hidden_states[i + 1]` (SGLang's `layers_to_capture = [i + 1]`).
- `final_state`: the last state is taken after the final norm (the input to lm_head).
"""

import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import Literal, TypedDict

from pydantic import BaseModel

from shared.errors import Eagle3Error

AUX_LAYER_CONVENTION = "decoder layer i output = HF hidden_states[i + 1]"
# Files whose bytes are the target's weights, in the formats transformers reads.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")


class Provenance(BaseModel):
    target_config_sha256: str  # config.json, canonical JSON
    target_weights_sha256: str  # every weight file, by name and content
    tokenizer_sha256: str  # the tokenizer files present (TOKENIZER_FILES)
    chat_template_sha256: str
    aux_layer_ids: list[int]
    aux_layer_convention: str = AUX_LAYER_CONVENTION
    final_state: Literal["post_norm"] = "post_norm"
    dtype: str  # of the capture, as the inference server returns it
    storage_dtype: str  # at rest (shared/storage/sample_format.py)
    vocab_mapping_sha256: str


class IncompatibleProvenance(Eagle3Error):
    """Hidden states (or a checkpoint) that do not match what they are being combined with; names the field."""

    def __init__(self, what: str, field: str, found: object, expected: object) -> None:
        super().__init__(f"{what}: provenance field {field} is {found!r}, expected {expected!r}")
        self.field, self.found, self.expected = field, found, expected


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def target_config_sha256(model_path: Path) -> str:
    config = json.loads((model_path / "config.json").read_text())
    return sha256_bytes(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())


@lru_cache(maxsize=8)
def _weights_sha256(model_path: Path, stamp: tuple[tuple[str, int, int], ...]) -> str:
    digest = hashlib.sha256()
    for name, _, _ in stamp:
        digest.update(name.encode())
        with (model_path / name).open("rb") as weights:
            while chunk := weights.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def target_weights_sha256(model_path: Path) -> str:
    """sha256 over every weight file (a full read, once per process for unchanged files)."""
    files = sorted(p for p in model_path.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    stamp = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    return _weights_sha256(model_path, stamp)


def tokenizer_sha256(model_path: Path) -> str:
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = model_path / name
        if path.is_file():
            digest.update(name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


class TargetIdentity(TypedDict):
    """The fields of a Provenance that a target folder alone determines."""

    target_config_sha256: str
    target_weights_sha256: str
    tokenizer_sha256: str


def target_identity(model_path: Path) -> TargetIdentity:
    """The fields of a Provenance that a target folder alone determines."""
    return {
        "target_config_sha256": target_config_sha256(model_path),
        "target_weights_sha256": target_weights_sha256(model_path),
        "tokenizer_sha256": tokenizer_sha256(model_path),
    }


def compute_provenance(
    model_path: Path,
    *,
    chat_template_sha256: str,
    aux_layer_ids: list[int],
    dtype: str,
    storage_dtype: str,
    vocab_mapping: bytes,
) -> Provenance:
    return Provenance(
        **target_identity(model_path),
        chat_template_sha256=chat_template_sha256,
        aux_layer_ids=list(aux_layer_ids),
        dtype=dtype,
        storage_dtype=storage_dtype,
        vocab_mapping_sha256=sha256_bytes(vocab_mapping),
    )


def check_same(found: Provenance | dict, expected: Provenance | dict, *, what: str) -> None:
    """Raise IncompatibleProvenance for the first field (in declaration order) where `found` differs."""
    found_fields = found.model_dump() if isinstance(found, Provenance) else found
    expected_fields = expected.model_dump() if isinstance(expected, Provenance) else expected
    for field in Provenance.model_fields:
        if field in found_fields and field in expected_fields and found_fields[field] != expected_fields[field]:
            raise IncompatibleProvenance(what, field, found_fields[field], expected_fields[field])
