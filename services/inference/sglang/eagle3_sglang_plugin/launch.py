"""The container's entry point: `python -m eagle3_sglang_plugin.launch [extra SGLang arguments]`.

Builds `python -m sglang.launch_server` arguments from the environment and replaces this process with it.
Every flag below exists in SGLang v0.5.23 (`python/sglang/srt/arg_groups/fields/*.py`):

- `--skip-tokenizer-init`: prompts arrive as token ids and answers carry `output_ids` (no detokenizer work).
- `--chunked-prefill-size -1`: a chunked prefill would hand the scheduler only the last chunk's rows.
- `--disable-radix-cache`: a prefix-cache hit computes fewer rows than the prompt (the plugin also sends a fresh
  `extra_key` per prompt, and refuses a short capture either way).
- `--enable-return-aux-hidden-states --speculative-algorithm EAGLE3 --return-aux-hidden-state-layer-ids I J K`:
  stock aux capture on the target without a draft (`arg_groups/validation_hook.py:
  handle_aux_hidden_state_capture`); the ids are ours (layer outputs), SGLang adds 1 itself.
- `--disable-prefill-cuda-graph` (unless EAGLE3_SGLANG_PREFILL_CUDA_GRAPH=1): the prefill graph's outputs are
  views of static buffers, and the post-norm rows are read after the forward; eager prefill takes that risk away
  at a small cost for the long prompts of a capture job.
- `--enable-prefill-delayer --prefill-delayer-queue-min-ratio 0.2` (unless EAGLE3_SGLANG_PREFILL_DELAYER=0): a
  regeneration job keeps hundreds of requests decoding, each finished turn sends the next, and without the delayer
  SGLang stops its whole decode batch for a prefill of the one or two turns that just arrived (8,537 such prefills
  in a 12,000-prompt job); the delayer holds new turns until a fifth of the running batch (or as many as recent
  prefills took) waits, at most 30 decode passes. On an H200 (2026-12-05) the GPU demo's regeneration ran 936
  prefills for 36,856 turns at 24.6K tokens/s (14.5K without it, on an H100). A capture job is untouched: its
  requests end at their prefill, so nothing runs that a prefill could wait behind.
- `--enable-deterministic-inference` (only when EAGLE3_SGLANG_DETERMINISTIC_INFERENCE=1): SGLang 0.5.23 reads a
  request's `sampling_seed` only in this mode (`sampling/sampling_batch_info.py`); without it two requests with
  the same seed sample different tokens. A regeneration job with `temperature > 0` and a `seed` is reproducible
  only on such a server. The mode swaps in batch-invariant kernels (`batch_invariant_ops`) and forces the
  pytorch sampling backend, so it is off by default: capture jobs and greedy decoding do not need it.

Environment (EAGLE3_ prefix, as the rest of the project):
  EAGLE3_MODEL_PATH          model folder inside the container (default /models/target)
  EAGLE3_INFERENCE_HOST/PORT where SGLang listens (default 0.0.0.0:30000)
  EAGLE3_AUX_LAYER_IDS       e.g. "1,15,28"; default EAGLE-3's [1, N//2 - 1, N - 4] from the model's config.json
  EAGLE3_SHM_DIR             the shared directory for captures (default /dev/shm/eagle3), created here
  EAGLE3_SGLANG_TP_SIZE      tensor-parallel size (default 1)
  EAGLE3_SGLANG_MEM_FRACTION_STATIC   passed as --mem-fraction-static when set
  EAGLE3_SGLANG_SKIP_TOKENIZER_INIT   1 (default) or 0 to keep SGLang's tokenizer (text prompts, decoded text)
  EAGLE3_SGLANG_PREFILL_CUDA_GRAPH    0 (default) or 1
  EAGLE3_SGLANG_PREFILL_DELAYER       1 (default) or 0 (SGLang's delayer needs its overlap scheduler: 0 with
                                      --disable-overlap-schedule)
  EAGLE3_SGLANG_DETERMINISTIC_INFERENCE   0 (default) or 1: seeded sampling repeats (see above)
"""

import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from shared.capture.protocol import default_aux_layer_ids

from .config import PluginConfig, PluginConfigError, check_capture_layer_ids, parse_layer_ids

DEFAULT_MODEL_PATH = "/models/target"
PREFILL_DELAYER_QUEUE_MIN_RATIO = 0.2  # new turns wait until a fifth of the running batch is waiting (see above)


def num_hidden_layers(model_path: Path) -> int:
    """The decoder layer count from a Hugging Face folder's config.json (text config of a multimodal model)."""
    config_path = model_path / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError as exc:
        raise PluginConfigError(
            f"EAGLE3_MODEL_PATH: {config_path} does not exist; is the model volume mounted?"
        ) from exc
    text_config = config.get("text_config") or config
    if "num_hidden_layers" not in text_config:
        raise PluginConfigError(f"{config_path}: no num_hidden_layers")
    return int(text_config["num_hidden_layers"])


def _flag(environ: Mapping[str, str], name: str, default: bool) -> bool:
    value = environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off"}:
        return False
    raise PluginConfigError(f"{name}: {value!r} is not 0 or 1")


def launch_argv(environ: Mapping[str, str], extra_args: Sequence[str] = ()) -> list[str]:
    """The `sglang.launch_server` argument list (after `python -m`) for this environment."""
    model_path = Path(environ.get("EAGLE3_MODEL_PATH") or DEFAULT_MODEL_PATH)
    n_layers = num_hidden_layers(model_path)
    ids_text = environ.get("EAGLE3_AUX_LAYER_IDS", "").strip()
    layer_ids = parse_layer_ids(ids_text) if ids_text else default_aux_layer_ids(n_layers)
    layer_ids = check_capture_layer_ids(layer_ids, n_layers)

    argv = [
        "sglang.launch_server",
        "--model-path",
        str(model_path),
        "--host",
        environ.get("EAGLE3_INFERENCE_HOST") or "0.0.0.0",
        "--port",
        environ.get("EAGLE3_INFERENCE_PORT") or "30000",
        "--tp-size",
        environ.get("EAGLE3_SGLANG_TP_SIZE") or "1",
        "--chunked-prefill-size",
        "-1",
        "--disable-radix-cache",
        "--enable-return-aux-hidden-states",
        "--speculative-algorithm",
        "EAGLE3",
        "--return-aux-hidden-state-layer-ids",
        *(str(i) for i in layer_ids),
    ]
    if _flag(environ, "EAGLE3_SGLANG_SKIP_TOKENIZER_INIT", True):
        argv.append("--skip-tokenizer-init")
    if not _flag(environ, "EAGLE3_SGLANG_PREFILL_CUDA_GRAPH", False):
        argv.append("--disable-prefill-cuda-graph")
    if _flag(environ, "EAGLE3_SGLANG_PREFILL_DELAYER", True):
        argv += ["--enable-prefill-delayer", "--prefill-delayer-queue-min-ratio", str(PREFILL_DELAYER_QUEUE_MIN_RATIO)]
    if _flag(environ, "EAGLE3_SGLANG_DETERMINISTIC_INFERENCE", False):
        argv.append("--enable-deterministic-inference")
    if mem_fraction := environ.get("EAGLE3_SGLANG_MEM_FRACTION_STATIC", "").strip():
        argv += ["--mem-fraction-static", mem_fraction]
    return [*argv, *extra_args]


def main() -> None:
    environ = dict(os.environ)
    try:
        argv = launch_argv(environ, sys.argv[1:])
        PluginConfig.from_env(environ).shm_dir.mkdir(parents=True, exist_ok=True)
    except PluginConfigError as exc:
        sys.exit(f"eagle3 sglang launch: {exc}")
    plugins = environ.get("SGLANG_PLUGINS", "").strip()
    if plugins and "eagle3_capture" not in plugins.split(","):
        sys.exit("eagle3 sglang launch: SGLANG_PLUGINS is set and does not list eagle3_capture")
    print("eagle3 sglang launch:", sys.executable, "-m", " ".join(argv), flush=True)
    os.execv(sys.executable, [sys.executable, "-m", *argv])


if __name__ == "__main__":
    main()
