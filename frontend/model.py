"""What a frontend knows of the served model: manifest, tokenizer and chat template, read from the core."""

from __future__ import annotations

from bisect import bisect_right
from pathlib import Path

from tokenizers import Tokenizer

from common.errors import InvalidRequest
from common.manifest import Manifest, load_manifest
from frontend.templates import ChatTemplate, TemplateError

TOKENIZER_FILE = "tokenizer.json"
TEMPLATE_FILE = "chat_template.jinja"


class ServedModel:
    def __init__(self, core: Path) -> None:
        self.manifest: Manifest = load_manifest(core, verify=True, only=(TOKENIZER_FILE, TEMPLATE_FILE))
        self.tokenizer = Tokenizer.from_file(str(core / TOKENIZER_FILE))
        self.name = self.manifest.served_names[0]
        template = core / TEMPLATE_FILE
        bos = self.manifest.bos_token_id
        eos = self.manifest.eos_token_ids
        self.template = ChatTemplate(
            template.read_text(), bos_token=self.tokenizer.id_to_token(bos) if bos is not None else "",
            eos_token=self.tokenizer.id_to_token(eos[0]) if eos else "") if template.is_file() else None

    def knows(self, name: str) -> bool:
        return name in self.manifest.served_names or name == self.manifest.checkpoint

    def encode_chat(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool,
                    extra: dict) -> tuple[list[int], list[int]]:
        """Render and tokenize a conversation: (token ids, token positions where a message ended)."""
        if self.template is None:
            raise InvalidRequest("this model has no chat template; use /v1/completions")
        try:
            rendered = self.template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                            **extra)
        except TemplateError as exc:
            raise InvalidRequest(f"the chat template rejected the conversation: {exc}", param="messages") from None
        encoding = self.tokenizer.encode(rendered.text, add_special_tokens=False)
        token_ends = [end for _, end in encoding.offsets]
        return encoding.ids, [bisect_right(token_ends, offset) for offset in rendered.message_ends]

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
