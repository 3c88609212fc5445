"""What a frontend knows of the served model: manifest, tokenizer and chat template, read from the core."""

from __future__ import annotations

import json
from bisect import bisect_right
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

from tokenizers import Tokenizer

from common.errors import InvalidRequest
from common.manifest import DECISION_FILES, Manifest, Pooling, load_manifest
from common.protocol import ImageInput
from frontend.chat import reasoning, tool_parsers
from frontend.chat.templates import ChatTemplate, TemplateError
from frontend.chat.tools import for_template, template_supports_tools
from frontend.detokenizer import special_token_ids
from frontend.limits import check_prompt_chars
from frontend.prefix_tokens import PrefixTokenizer

TOKENIZER_FILE = "tokenizer.json"
TEMPLATE_FILE = "chat_template.jinja"
# Special tokens a reply parser reads, so they stay in the text (Mistral's [TOOL_CALLS] is special).
MARKERS = {"reasoning": (reasoning.OPEN, reasoning.CLOSE),
           "hermes": (tool_parsers.HermesParser.OPEN, tool_parsers.HermesParser.CLOSE),
           "mistral": (tool_parsers.MISTRAL_OPEN, "[ARGS]", "[CALL_ID]")}


class EncodedChat(NamedTuple):
    ids: list[int]
    message_ends: list[int]  # token positions where a message ended
    opens_reasoning: bool  # the prompt leaves <think> open: the reply starts inside its reasoning
    images: list[ImageInput] = []  # prepared images, at their placeholders (frontend/images/inputs.py)


class ServedModel:
    def __init__(self, core: Path, pooling: str | None = None) -> None:
        """`pooling`: serve embeddings pooled so ("last" or "mean", L2-normalised), whatever the core says
        (flare run --pooling)."""
        self.manifest: Manifest = load_manifest(core, verify=True, only=(TOKENIZER_FILE, TEMPLATE_FILE,
                                                                          *DECISION_FILES))
        self.core = core
        # How an embedding is pooled; None: the core generates only (docs/design.md, Embeddings).
        self.pooling: Pooling | None = Pooling(pooling, normalize=True) if pooling else self.manifest.pooling
        self.tokenizer = Tokenizer.from_file(str(core / TOKENIZER_FILE))
        self.prefix_tokens = PrefixTokenizer(self.tokenizer)  # long prompts sharing a beginning encode once
        self.name = self.manifest.served_names[0]
        template = core / TEMPLATE_FILE
        bos = self.manifest.bos_token_id
        eos = self.manifest.eos_token_ids
        self.template = ChatTemplate(
            template.read_text(), bos_token=self.tokenizer.id_to_token(bos) if bos is not None else "",
            eos_token=self.tokenizer.id_to_token(eos[0]) if eos else "") if template.is_file() else None
        self.template_source = template.read_text() if template.is_file() else ""
        self.supports_tools = template_supports_tools(self.template_source)
        # What the replies look like, read from the template (README.md, Reasoning and tool calls).
        self.reasons = reasoning.template_reasons(self.template_source)
        self.tool_format = tool_parsers.tool_format(self.template_source)
        kept = MARKERS[self.tool_format] + (MARKERS["reasoning"] if self.reasons else ())
        self.hidden_token_ids = special_token_ids(self.tokenizer, keep=kept)
        self.token_bytes: Callable[[int], bytes] = lru_cache(maxsize=1 << 16)(token_bytes_reader(self.tokenizer))

    def knows(self, name: str) -> bool:
        return name in self.manifest.served_names or name == self.manifest.checkpoint

    def encode_chat(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool,
                    extra: dict, continue_final: bool = False) -> EncodedChat:
        """Render and tokenize a conversation.
        `continue_final`: the last message is the start of the reply (Anthropic's prefill), so the prompt stops
        right after its text instead of closing it."""
        if self.template is None:
            raise InvalidRequest("this model has no chat template; use /v1/completions")
        messages, tools = for_template(messages, tools, self.supports_tools, self.tool_format)
        try:
            rendered = self.template.render(messages, tools=tools,
                                            add_generation_prompt=add_generation_prompt and not continue_final,
                                            **extra)
        except TemplateError as exc:
            raise InvalidRequest(f"the chat template rejected the conversation: {exc}", param="messages") from None
        text, ends = rendered.text, rendered.message_ends
        if continue_final:
            final = messages[-1]["content"]
            cut = text.rfind(final) + len(final) if final else -1
            if cut < len(final):
                raise InvalidRequest("the final assistant message cannot be continued with this chat template",
                                     param="messages")
            text, ends = text[:cut], [end for end in ends if end <= cut]
        check_prompt_chars(len(text), self.manifest.context_limit, "messages")
        tokens = self.prefix_tokens.encode(text)
        opens = self.reasons and reasoning.opens_reasoning(text[ends[-1]:] if ends else text)
        return EncodedChat(tokens.ids, [bisect_right(tokens.ends, offset) for offset in ends], opens)

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        check_prompt_chars(len(text), self.manifest.context_limit, "prompt")
        return self.prefix_tokens.ids(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE spells each byte as one printable character; this maps them back."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {chr(b if b in printable else next(extra)): b for b in range(256)}


def token_bytes_reader(tokenizer: Tokenizer) -> Callable[[int], bytes]:
    """The exact bytes of one token (logprobs report them): decoding a lone token would turn a piece of a
    multi-byte character into U+FFFD."""
    decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
    kinds = {d.get("type") for d in decoder.get("decoders", [decoder]) if isinstance(d, dict)}
    if "ByteLevel" in kinds:
        alphabet = _byte_level_alphabet()

        def byte_level(token_id: int) -> bytes:
            piece = tokenizer.id_to_token(token_id) or ""
            return b"".join(bytes([alphabet[c]]) if c in alphabet else c.encode() for c in piece)
        return byte_level
    if "ByteFallback" in kinds or "Metaspace" in kinds or "Replace" in kinds:
        def sentencepiece(token_id: int) -> bytes:
            piece = tokenizer.id_to_token(token_id) or ""
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
            return piece.replace("\u2581", " ").encode()
        return sentencepiece
    return lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False).encode()
