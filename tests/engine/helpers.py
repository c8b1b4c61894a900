"""Test fixtures that need no download: a tiny byte-level BPE tokenizer (trained in
milliseconds, so multi-byte characters really are split across tokens) and tiny
random checkpoints saved by transformers."""

from __future__ import annotations

import functools

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. What is the capital of Italy?",
    "user assistant system: answer politely and briefly.",
]


@functools.lru_cache(maxsize=4)
def bpe_backend(specials: tuple[str, ...] = tuple(SPECIALS), corpus: tuple[str, ...] = tuple(_CORPUS)):
    """A byte-level BPE of 400 tokens trained on `corpus`, with `specials` first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=list(specials), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator(list(corpus) * 5, trainer)
    return tk


def make_tokenizer():
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe_backend(), bos_token="<|endoftext|>", eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_tiny_llama(path: str, vocab_size: int = 512, with_tokenizer: bool = True, **overrides) -> object:
    """A 2-layer random Llama in `path` (float32 safetensors + tokenizer files)."""
    import torch
    import transformers

    tok = make_tokenizer()
    cfg = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.15, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **overrides,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(path)
    if with_tokenizer:
        tok.save_pretrained(path)
    return cfg
