"""Fill in the middle: a code model trained on it reads `prefix`, `suffix`, then writes the middle, in the
prefix-suffix-middle order its tokenizer's three tokens mark. Ollama's generate asks for it with `suffix`; a model
whose vocabulary has the tokens lists the `insert` capability."""

from __future__ import annotations

from tokenizers import Tokenizer

# (prefix, suffix, middle) as Qwen2.5-Coder and Qwen3 spell them, then StarCoder and SmolLM.
SPELLINGS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"))


def fim_tokens(tokenizer: Tokenizer) -> tuple[str, str, str] | None:
    return next((s for s in SPELLINGS if all(tokenizer.token_to_id(t) is not None for t in s)), None)


def fim_prompt(tokens: tuple[str, str, str], prefix: str, suffix: str) -> str:
    start, hole, middle = tokens
    return f"{start}{prefix}{hole}{suffix}{middle}"
