"""The target as the producer, the doctor and the trainer read it from its folder, for the two shapes of
config.json that released models have beyond a plain causal LM's: an embedding padded past the tokenizer, and a
multimodal model whose language model is nested (`text_config`, tensors under `language_model`)."""

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from services.trainer.data import TargetSignature
from services.trainer.drafter import (
    DrafterConfig,
    TargetHead,
    load_target_embeddings,
    load_target_final_norm,
)
from shared.data.datasets import Conversation, Message
from shared.data.tokenization import ChatTokenizer
from shared.data.vocab import load_vocab_mapping
from shared.lifecycle.kind import Target, TargetModel
from shared.lifecycle.kinds.extract import Extract
from shared.lifecycle.schemas import JobSpec

CONVERSATION = Conversation(
    sample_id="s0",
    line=1,
    messages=[Message(role="user", content="Hello there"), Message(role="assistant", content="Hi! How are you?")],
)


def copy_with_config(model_dir: Path, out: Path, rewrite: Callable[[dict[str, Any]], dict[str, Any]]) -> Path:
    """A copy of the model folder whose config.json is `rewrite` of the original's."""
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(rewrite(config)))
    return out


def test_an_extraction_is_planned_for_the_models_vocabulary_not_the_tokenizers(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """What an inference server reports, and what the drafter's t2d has one entry per."""
    rows = 4 * ChatTokenizer.from_pretrained(tiny_model_dir).vocab_size
    model_dir = copy_with_config(tiny_model_dir, tmp_path / "padded", lambda config: {**config, "vocab_size": rows})

    target = Target.load(model_dir, ChatTokenizer.from_pretrained(model_dir), None)
    kind, spec = Extract(), JobSpec(dataset_url="-", draft_vocab_size=64)
    plan = kind.plan("job-padded", spec, target, [kind.accept(CONVERSATION, spec, target)])

    assert target.record().vocab_size == rows
    (mapping_bytes,) = plan.files.values()
    mapping = load_vocab_mapping(mapping_bytes)
    assert mapping.t2d.numel() == rows
    assert mapping.draft_vocab_size == 64


def test_a_multimodal_targets_language_model_is_read_from_its_nested_config_and_tensors(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """As Llama 4's released checkpoints store it: config under `text_config`, tensors under `language_model.`."""
    text_config = json.loads((tiny_model_dir / "config.json").read_text())
    config = {
        "architectures": ["Llama4ForConditionalGeneration"],
        "text_config": text_config,
        "vision_config": {"hidden_size": 32},
    }
    model_dir = copy_with_config(tiny_model_dir, tmp_path / "multimodal", lambda _: config)
    (weights_file,) = model_dir.glob("*.safetensors")
    tensors = load_file(weights_file)
    save_file({f"language_model.{name}": tensor for name, tensor in tensors.items()}, weights_file)

    target = Target.load(model_dir, ChatTokenizer.from_pretrained(model_dir), None)
    record = target.record()
    shape = (text_config["hidden_size"], text_config["num_hidden_layers"], text_config["vocab_size"])
    assert (record.hidden_size, record.num_hidden_layers, record.vocab_size) == shape
    assert record.architecture == "Llama4ForConditionalGeneration"
    checked = TargetModel.read(model_dir, None)
    assert (checked.hidden_size, checked.num_hidden_layers, checked.vocab_size) == shape
    assert checked.aux_layer_ids == target.aux_layer_ids
    signature = TargetSignature.from_model_config(config, target.aux_layer_ids)
    assert (signature.hidden_size, signature.num_hidden_layers) == shape[:2]

    drafter_config = DrafterConfig.from_target_config(config, draft_vocab_size=64, aux_layer_ids=target.aux_layer_ids)
    assert (drafter_config.hidden_size, drafter_config.vocab_size) == (shape[0], shape[2])
    embedding = tensors["model.embed_tokens.weight"]
    assert torch.equal(load_target_embeddings(model_dir), embedding)
    assert torch.equal(load_target_final_norm(model_dir), tensors["model.norm.weight"])
    assert text_config["tie_word_embeddings"]  # the head is the embedding, found under its nested name
    assert torch.equal(TargetHead.from_pretrained(model_dir, dtype=embedding.dtype).weight, embedding)
