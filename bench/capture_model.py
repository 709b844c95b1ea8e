"""The model and prompts of the capture benchmarks (bench/capture.py, bench/sglang_capture.py, bench/multi_gpu.py).

Light on imports (torch and transformers only) so that a GPU host can build the model before the rest of the
project's dependencies are there:

    python -m bench.capture_model /tmp/models/llama-3.1-8b-random
"""

import argparse
import json
from pathlib import Path
from typing import Any

import torch

LLAMA_31_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
               "rope_theta": 500000.0, "rms_norm_eps": 1e-5}  # fmt: skip
RANDOM_8B = "llama-3.1-8b-random"


def random_llama_8b(out_dir: Path, *, weights: bool = True) -> Path:
    """A Llama-3.1-8B-shaped model with random bf16 weights (no hub here), saved once as a Hugging Face folder.
    Without `weights`, only its config and tokenizer: for a server that draws random weights itself (SGLang's
    `--load-format dummy`), with no 16 GB of files to write, read and hash."""
    if (out_dir / "config.json").exists():
        return out_dir
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.builders import build_tiny_llama

    build_tiny_llama(out_dir)  # the tokenizer; its model files are replaced below
    # The architecture named as a saved model names it: servers pick their model class by it.
    config = LlamaConfig(**LLAMA_31_8B, torch_dtype="bfloat16", architectures=["LlamaForCausalLM"])
    if not weights:
        for tiny_weights in out_dir.glob("*.safetensors*"):
            tiny_weights.unlink()
        config.save_pretrained(out_dir)
        return out_dir
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # the GPU is the server's next, in another process
    return out_dir


def capture_model(name: str, work: Path) -> tuple[Path, dict[str, Any]]:
    """The model a capture benchmark runs ("llama-3.1-8b-random", "smollm2" or a local folder) and its config."""
    if name == RANDOM_8B:
        model_dir = random_llama_8b(work / name)
    else:
        from shared.data.model_assets import resolve_model_path

        model_dir = resolve_model_path(name)
    return model_dir, json.loads((model_dir / "config.json").read_text())


def bench_prompts(count: int, length: int, vocab_size: int) -> list[list[int]]:
    """The benchmarks' prompts: the same random token ids for every backend (seed 0, ids clear of special tokens)."""
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(100, min(vocab_size, 30000), (length,), generator=generator).tolist() for _ in range(count)]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path, help="where the random Llama-3.1-8B-shaped model is saved")
    print(random_llama_8b(parser.parse_args().out_dir))
