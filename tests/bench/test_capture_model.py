"""bench/capture_model's Llama-3.1-8B-shaped folder without weights, as SGLang reads it with `--load-format dummy`."""

import json
from pathlib import Path

from bench.capture_model import LLAMA_31_8B, random_llama_8b


def test_the_weightless_8b_folder_names_its_architecture_and_holds_no_weights(tmp_path: Path) -> None:
    model_dir = random_llama_8b(tmp_path / "llama", weights=False)
    config = json.loads((model_dir / "config.json").read_text())
    # SGLang picks the model class by the first architecture: a config saved without a model has none.
    assert config["architectures"] == ["LlamaForCausalLM"]
    shape = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_key_value_heads", "vocab_size")
    assert {key: config[key] for key in shape} == {key: LLAMA_31_8B[key] for key in shape}
    assert not list(model_dir.glob("*.safetensors*"))
    assert (model_dir / "tokenizer.json").exists()
