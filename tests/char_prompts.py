"""Token ids of text prompts for the tiny character model: what ``render_prompts`` gives in raw format."""

from __future__ import annotations

from functools import cache

from coba_tasks.engines.model import build_char_tokenizer


@cache
def _tokenizer():
    return build_char_tokenizer()


def char_ids(text: str) -> tuple[int, ...]:
    """The token ids of ``text`` for the tiny character model (one per character, no special tokens)."""
    return tuple(_tokenizer()(text).input_ids)


def with_char_ids(df):
    """``df`` (with ``prompt_text``) rendered in raw format for the character model, as ``render_prompts`` does."""
    return df.assign(prompt_rendered=df["prompt_text"], prompt_token_ids=[list(char_ids(t)) for t in df["prompt_text"]])
