"""Cores for the scripted engine that pair the default core's tokenizer with a model family's real chat template,
and with the added tokens that family's tokenizer has (Qwen's `<think>` and `<tool_call>` are plain added tokens,
Mistral's `[TOOL_CALLS]` and `[ARGS]` are special ones). Only the frontend reads these cores: no weights."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
from tokenizers import AddedToken, Tokenizer

from common.manifest import load_manifest, sha256_file, write_manifest
from ignition.template_marks import annotate
from tests.frontend.test_templates import CORPUS

QWEN_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_suffix|>",
               "<|fim_middle|>")
MISTRAL_SPECIAL = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                   "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[INST]", "[/INST]")


def differential_template(name: str) -> str:
    return (CORPUS / "differential" / f"{name}.jinja").read_text()


def corpus_template(model: str) -> str:
    """A template from the Hugging Face corpus (cases.json), e.g. Qwen/Qwen3-0.6B's own."""
    return json.loads((CORPUS / "cases.json").read_text())[model]["chat_template"]


def family_core(base: Path, out: Path, name: str, template: str, tokens: tuple[str, ...] = (),
                special: tuple[str, ...] = ()) -> Path:
    """`base`'s tokenizer with `tokens` and `special` added, `template` annotated as ignition annotates it."""
    out.mkdir(parents=True)
    tokenizer = Tokenizer.from_file(str(base / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in tokens])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "chat_template.jinja").write_text(annotate(template))
    files = {f: sha256_file(out / f) for f in ("tokenizer.json", "chat_template.jinja")}
    write_manifest(out, msgspec.structs.replace(load_manifest(base), served_names=[name], files=files))
    return out
