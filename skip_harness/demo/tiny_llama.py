"""A tiny causal language model saved locally, for examples and tests that need a real Hugging Face
model without Hub access: a 2-layer Llama (hidden 64) built from its config, with random weights, and a
character tokenizer made with `tokenizers`. Needs the `[trl]` extra (transformers, tokenizers)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Union

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789+=? "
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]


def save_tiny_llama(model_dir: Union[str, os.PathLike], seed: int = 0) -> str:
    """Save the tiny Llama and its tokenizer into `model_dir` unless a model is there already; return the
    directory as a string, to pass where a model name goes (``GRPOTrainer(model=...)``,
    ``from_pretrained``). The same seed gives the same weights."""
    model_dir = Path(model_dir)
    if (model_dir / "config.json").exists():
        return str(model_dir)
    import torch
    from tokenizers import Tokenizer, decoders, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(CHARS))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
    )
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(state)   # building the model leaves the caller's random stream alone
    model_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return str(model_dir)
