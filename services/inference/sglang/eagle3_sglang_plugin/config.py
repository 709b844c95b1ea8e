"""The plugin's settings, and the capture layer ids in our convention and in SGLang's.

Layer-id conventions (SGLang v0.5.23, `python/sglang/srt/models/llama.py`):
- Ours (docs/capture-protocol.md): id i is the residual-stream *output* of decoder layer i, Hugging Face
  `output_hidden_states[i + 1]`.
- SGLang's `LlamaModel.layers_to_capture`: layer j captures its *input* (`hidden_states + residual`), i.e. the
  output of layer j - 1. `LlamaForCausalLM.set_eagle3_layers_to_capture(layer_ids)` stores `[i + 1 for i in
  layer_ids]`, so `--return-aux-hidden-state-layer-ids` takes our ids unchanged.
- Consequences: the last layer (i = N - 1) cannot be captured (nothing runs after it; `LogitsProcessor.
  _check_aux_hidden_states` fails the first forward), and the captures come out in ascending layer order
  whatever order the ids were given in (`LlamaModel.forward` tests `i in self.layers_to_capture` per layer).
"""

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from shared.capture.protocol import default_aux_layer_ids
from shared.storage.sample_format import NUM_AUX_LAYERS

DEFAULT_SHM_DIR = Path("/dev/shm/eagle3")
DEFAULT_CAPTURE_WRITERS = 4  # a batch's files are written in parallel, off the scheduler's thread


class PluginConfigError(ValueError):
    """A plugin setting or launch argument that cannot work; names the setting and the reason."""


@dataclass(frozen=True)
class PluginConfig:
    """What every SGLang process of the plugin reads from the environment (child processes inherit it)."""

    # Where the scheduler writes captures: the shared directory of transport "shm" (the worker mounts it),
    # and the spool of transport "body" (hidden files the HTTP process reads back and deletes).
    shm_dir: Path = DEFAULT_SHM_DIR
    # Threads of the scheduler process that write capture files (capture.CaptureWriter); 0 writes on the
    # scheduler's own thread, which then waits for the bytes before it runs the next batch.
    capture_writers: int = DEFAULT_CAPTURE_WRITERS

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "PluginConfig":
        # EAGLE3_SHM_DIR is the project's setting of the same meaning (shared/settings.py: shm_dir).
        shm_dir = environ.get("EAGLE3_SHM_DIR", "").strip()
        writers_text = environ.get("EAGLE3_SGLANG_CAPTURE_WRITERS", "").strip()
        try:
            writers = int(writers_text) if writers_text else DEFAULT_CAPTURE_WRITERS
            if writers < 0:
                raise ValueError("negative")
        except ValueError as exc:
            raise PluginConfigError(
                f"EAGLE3_SGLANG_CAPTURE_WRITERS: {writers_text!r} is not a thread count (0 or more)"
            ) from exc
        return cls(shm_dir=Path(shm_dir) if shm_dir else DEFAULT_SHM_DIR, capture_writers=writers)


def parse_layer_ids(text: str, *, setting: str = "EAGLE3_AUX_LAYER_IDS") -> list[int]:
    """Layer ids from "1,14,26", "1 14 26" or "[1, 14, 26]"."""
    stripped = text.strip()
    try:
        if stripped.startswith("["):
            values = json.loads(stripped)
            if not isinstance(values, list):
                raise ValueError("not a list")
        else:
            values = [part for part in stripped.replace(",", " ").split() if part]
        ids = [int(v) for v in values]
        if any(isinstance(v, bool | float) for v in values):
            raise ValueError("not integers")
    except (ValueError, TypeError) as exc:
        raise PluginConfigError(f"{setting}: {text!r} is not a list of layer ids such as '1,14,26': {exc}") from exc
    return ids


def check_capture_layer_ids(
    layer_ids: list[int], num_hidden_layers: int, *, setting: str = "EAGLE3_AUX_LAYER_IDS"
) -> list[int]:
    """The ids sorted ascending (SGLang's capture order); raises PluginConfigError for ids SGLang cannot capture."""
    if len(layer_ids) != NUM_AUX_LAYERS:
        raise PluginConfigError(f"{setting}: needs exactly {NUM_AUX_LAYERS} layer ids, got {layer_ids}")
    if len(set(layer_ids)) != len(layer_ids):
        raise PluginConfigError(f"{setting}: layer ids must be distinct, got {layer_ids}")
    last_capturable = num_hidden_layers - 2  # the output of layer N - 1 is nobody's input
    bad = [i for i in layer_ids if not 0 <= i <= last_capturable]
    if bad:
        raise PluginConfigError(
            f"{setting}: layer ids {bad} of {layer_ids} are outside [0, {last_capturable}] for this "
            f"{num_hidden_layers}-layer model (SGLang captures layer i as the input of layer i + 1, so the last "
            "layer cannot be captured)"
        )
    return sorted(layer_ids)


def resolve_capture_layer_ids(configured: list[int] | None, num_hidden_layers: int) -> list[int]:
    """The server's capture layers: the configured ids, else EAGLE-3's default [1, N//2 - 1, N - 4]."""
    ids = list(configured) if configured is not None else default_aux_layer_ids(num_hidden_layers)
    return check_capture_layer_ids(ids, num_hidden_layers, setting="--return-aux-hidden-state-layer-ids")


def sglang_layers_to_capture(layer_ids: list[int]) -> list[int]:
    """SGLang's `LlamaModel.layers_to_capture` for our ids (what `set_eagle3_layers_to_capture` stores)."""
    return [i + 1 for i in layer_ids]
