"""Builders for test inputs that no package ships: a tiny random Llama with a locally trained tokenizer."""

from pathlib import Path

CHATML_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_TRAINING_TEXT = [
    "Hello, how are you doing today?",
    "I am fine, thank you. What about you?",
    "The capital of France is Paris.",
    "Artificial intelligence is the branch of engineering and science devoted to constructing machines that think.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "Can you tell me a joke about computers?",
    "Numbers like 2024 and 12345 are split into digits.",
]


def build_tiny_llama(out_dir: Path, *, num_hidden_layers: int = 8, hidden_size: int = 64, seed: int = 0) -> Path:
    """A random LlamaForCausalLM (bf16 weights) plus a ChatML BPE tokenizer, saved as a Hugging Face folder."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out_dir.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    bpe.train_from_iterator(
        _TRAINING_TEXT * 4,
        trainers.BpeTrainer(
            vocab_size=512,
            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<pad>",
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
