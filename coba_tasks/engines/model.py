"""The embedded default model: a tiny Llama-architecture causal LM with a character tokenizer, built
offline (one token per printable ASCII character, plus <pad>, <s>, </s>, <unk>) and initialised from a seed,
saved in Hugging Face layout: any HF causal LM directory works wherever a model path is configured.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
CHARS = tuple(string.digits + string.ascii_letters + string.punctuation + " \n")


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Shape of the tiny model (defaults: ~0.12 M parameters; ~25k training tokens/s on one core)."""

    hidden_size: int = 64
    intermediate_size: int = 192
    num_hidden_layers: int = 2
    num_attention_heads: int = 2  # head_dim 32: supported by vLLM's CPU attention
    max_position_embeddings: int = 64
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False  # the default model keeps them apart; tests tie them, as most real models do


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character; decoding joins the characters back."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK, model_max_length=1024
    )


def tiny_config_kwargs(tokenizer: PreTrainedTokenizerFast, spec: TinyLlamaSpec) -> dict[str, Any]:
    """The config arguments of a tiny causal LM shaped by ``spec`` over ``tokenizer``'s vocabulary and special
    tokens (one key/value head per attention head); ``LlamaConfig(**...)``, or another architecture's config."""
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_attention_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=spec.tie_word_embeddings,
    )


def seeded_model(model_cls: Any, config: Any, tokenizer: PreTrainedTokenizerFast, seed: int) -> Any:
    """``model_cls(config)`` initialised under ``seed`` (the global RNG left as it was), generating with
    ``tokenizer``'s pad token: the same seed gives the same weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def build_tiny_llama(tokenizer: PreTrainedTokenizerFast, spec: TinyLlamaSpec, seed: int) -> LlamaForCausalLM:
    """A freshly initialised LlamaForCausalLM sized by ``spec``; the same seed gives the same weights."""
    return seeded_model(LlamaForCausalLM, LlamaConfig(**tiny_config_kwargs(tokenizer, spec)), tokenizer, seed)


def save_hf(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> Path:
    """Save model (safetensors) and tokenizer in Hugging Face layout; returns the directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
