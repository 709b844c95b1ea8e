"""Golden check for a GPU host: captures from a running server against transformers on the same model folder.

    python services/inference/sglang/golden_check.py --url http://127.0.0.1:30000 --model-path /models/target

Captures a few prompts of different lengths through the project's own client (`shared/capture/client.py`,
concurrently, so the server batches them into one flattened forward), runs the same prompts through
transformers, and prints for every captured layer the largest relative error over the prompts against
Hugging Face `output_hidden_states[id + 1]`, the layer the capture is nearest to, and the same for the final
state against the post-final-norm state. Exit status: 0 all good, 1 a check failed, 2 the check could not run.
The relative error and the nearest layer are those of the audit's comparison (`shared/capture/compare.py`).

A tolerance alone cannot be trusted to catch an off-by-one layer (adjacent layers are 21-30% apart per token on
SmolLM2-135M, and can be closer in a deeper model), so each slice must also be nearer to its own layer than to any
other.
Tolerances: those of bf16 storage in `shared/capture/compare.py`, measured there against fp32 among others.

Runs anywhere the project's `shared` package, torch and transformers import: the repo's venv, or inside the
SGLang container (`docker exec ... python3 /opt/eagle3/sglang-plugin/golden_check.py ...`). The transformers
model loads on `--device` (default cpu: the server holds most of the GPU's memory).
"""

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

if __package__ in (None, ""):
    # Run as a script from a checkout: the repo root holds `shared`.
    _repo_root = Path(__file__).resolve().parents[3]
    if (_repo_root / "shared").is_dir() and str(_repo_root) not in sys.path:
        sys.path.insert(0, str(_repo_root))

from shared.capture.client import InferenceClient
from shared.capture.compare import nearest, relative_error
from shared.capture.protocol import CapturedStates
from shared.capture.tolerances import DEFAULT_TOLERANCES
from shared.errors import Eagle3Error

# A bf16 capture against transformers: the audit's tolerances for bf16 storage.
AUX_REL_TOL = DEFAULT_TOLERANCES.bfloat16.aux
FINAL_REL_TOL = DEFAULT_TOLERANCES.bfloat16.final

PROMPT_TEXTS = [
    "The capital of France is Paris. It is known for the Eiffel Tower, the Louvre and its cafes.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Explain, step by step, why the sky is blue during the day and red at sunset. " * 4,
    "Hi",
]


@dataclass
class Check:
    name: str  # "aux[0] layer 1" or "final"
    reference: str  # what it is compared with
    max_rel_error: float
    nearest: str  # the reference nearest to the capture, in the worst prompt
    ok: bool


def compare(
    captures: list[CapturedStates],
    references: list[tuple[list[torch.Tensor], torch.Tensor]],
    aux_layer_ids: list[int],
    *,
    aux_tol: float = AUX_REL_TOL,
    final_tol: float = FINAL_REL_TOL,
) -> list[Check]:
    """One Check per aux slot and one for the final state, worst case over the prompts.

    references[p] = (layers, final): layers[i] is decoder layer i's output [L, H] for i in [0, N - 2] (Hugging
    Face output_hidden_states[i + 1]; transformers 5 stores the post-norm state in the last entry, so layer N - 1
    has no reference), final is the post-norm state [L, H].
    """
    checks = []
    for slot, layer_id in enumerate(aux_layer_ids):
        worst, nearest_in_worst, all_nearest = -1.0, -1, True
        for capture, (layers, _) in zip(captures, references, strict=True):
            width = layers[0].shape[-1]
            captured = capture.aux_hidden_state[:, slot * width : (slot + 1) * width]
            own = relative_error(captured, layers[layer_id]) if layer_id < len(layers) else float("inf")
            # nearest() judges without the first token, which cannot tell middle layers apart; where nothing can
            # tell the layers apart (a single token), the slice counts as its own layer.
            found = nearest(captured, layers)
            nearest_layer = layer_id if found is None else found
            all_nearest &= nearest_layer == layer_id
            if own > worst:
                worst, nearest_in_worst = own, nearest_layer
        checks.append(
            Check(
                name=f"aux[{slot}] layer {layer_id}",
                reference=f"output_hidden_states[{layer_id + 1}]",
                max_rel_error=worst,
                nearest=f"layer {nearest_in_worst}",
                ok=worst < aux_tol and all_nearest,
            )
        )
    worst, nearer_layer = -1.0, False
    for capture, (layers, final) in zip(captures, references, strict=True):
        error = relative_error(capture.hidden_state, final)
        worst = max(worst, error)
        nearer_layer |= min(relative_error(capture.hidden_state, layer) for layer in layers) <= error
    checks.append(
        Check(
            name="final",
            reference="post-norm (input to lm_head)",
            max_rel_error=worst,
            nearest="a decoder layer output" if nearer_layer else "post-norm",
            ok=worst < final_tol and not nearer_layer,
        )
    )
    return checks


def hf_references(model_path: Path, prompts: list[list[int]], device: str, dtype: torch.dtype) -> list:
    from transformers import AutoModelForCausalLM

    # transformers wraps PreTrainedModel.to in functools.wraps(Module.to), whose type leaves `self` unbound.
    model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True, dtype=dtype).to(device).eval()  # type: ignore[arg-type]
    references = []
    with torch.no_grad():
        for prompt in prompts:
            output = model.base_model(torch.tensor([prompt], device=device), output_hidden_states=True)
            layers = [h[0].float().cpu() for h in output.hidden_states[1:-1]]  # decoder layers 0 .. N - 2
            references.append((layers, output.last_hidden_state[0].float().cpu()))
    return references


def tokenize_prompts(model_path: Path, vocab_size: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    prompts = [tokenizer(text).input_ids for text in PROMPT_TEXTS]
    # One long prompt of random ordinary tokens: a length no chat sample is likely to hit exactly.
    generator = torch.Generator().manual_seed(0)
    prompts.append(torch.randint(100, min(vocab_size, 32000), (517,), generator=generator).tolist())
    return prompts


def print_report(checks: list[Check], rows: list[tuple[int, int]]) -> None:
    print(f"{'check':<20} {'against':<30} {'max rel err':>12}  {'nearest':<22} verdict")
    for check in checks:
        verdict = "ok" if check.ok else "FAIL"
        print(f"{check.name:<20} {check.reference:<30} {check.max_rel_error:>12.5f}  {check.nearest:<22} {verdict}")
    for prompt_len, captured_rows in rows:
        if prompt_len != captured_rows:
            print(f"rows: prompt of {prompt_len} tokens captured {captured_rows} rows  FAIL")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the inference server, e.g. http://127.0.0.1:30000")
    parser.add_argument("--model-path", required=True, type=Path, help="local Hugging Face folder of the served model")
    parser.add_argument("--aux-layer-ids", default=None, help="e.g. '1,14,26'; default: the server's defaults")
    parser.add_argument("--device", default="cpu", help="where transformers runs (cpu, cuda, cuda:1)")
    parser.add_argument("--hf-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--aux-tol", type=float, default=AUX_REL_TOL)
    parser.add_argument("--final-tol", type=float, default=FINAL_REL_TOL)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="wait this long for /health, per request too")
    args = parser.parse_args(argv)

    try:
        with InferenceClient(args.url, timeout_s=args.timeout_s, max_concurrency=len(PROMPT_TEXTS) + 1) as client:
            client.wait_ready(args.timeout_s)
            info = client.model_info()
            config = json.loads((args.model_path / "config.json").read_text())
            text_config = config.get("text_config") or config
            served = (info.num_hidden_layers, info.hidden_size)
            local = (text_config["num_hidden_layers"], text_config["hidden_size"])
            if served != local:
                print(f"the server's model (layers, hidden) {served} is not {args.model_path} {local}")
                return 2
            if args.aux_layer_ids:
                layer_ids = [int(i) for i in args.aux_layer_ids.replace(",", " ").split()]
            else:
                layer_ids = info.default_aux_layer_ids
            prompts = tokenize_prompts(args.model_path, info.vocab_size)
            requests = [(f"golden-check/{i}", prompt) for i, prompt in enumerate(prompts)]
            captures = list(client.capture_many(requests, layer_ids))
    except (Eagle3Error, OSError, KeyError) as exc:
        print(f"golden check could not run: {type(exc).__name__}: {exc}")
        return 2

    print(
        f"server {args.url}: backend={info.backend} version={info.version} model={info.model_path} "
        f"layers={info.num_hidden_layers} hidden={info.hidden_size} aux_layer_ids={layer_ids}"
    )
    print(f"prompts: {len(prompts)} of lengths {[len(p) for p in prompts]}")
    rows = [(len(p), c.hidden_state.shape[0]) for p, c in zip(prompts, captures, strict=True)]
    if any(prompt_len != captured for prompt_len, captured in rows):
        print_report([], rows)
        return 1
    references = hf_references(args.model_path, prompts, args.device, getattr(torch, args.hf_dtype))
    checks = compare(captures, references, layer_ids, aux_tol=args.aux_tol, final_tol=args.final_tol)
    print_report(checks, rows)
    ok = all(check.ok for check in checks)
    print("golden check passed" if ok else "golden check FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
