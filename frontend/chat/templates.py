"""Chat-template rendering on minijinja, configured to match transformers' jinja2 setup.

transformers renders Hugging Face chat templates with jinja2 (trim_blocks, lstrip_blocks, loop controls, a
json.dumps-based `tojson`, `raise_exception`, `strftime_now`, and `{% generation %}` blocks). minijinja is
configured the same way so prompts are byte-identical to what the model saw in training, without jinja2's
per-render Python overhead.

Annotated templates (ignition.template_marks) call `mark()` where each message ends; the renderer strips those
sentinels and reports their offsets so the engine can checkpoint the prefix cache at message boundaries.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
from datetime import datetime
from typing import Any, NamedTuple

import minijinja

__all__ = ["ChatTemplate", "Rendered", "TemplateError"]


class TemplateError(ValueError):
    """A chat template failed to compile or render (including the template's own raise_exception)."""


class Rendered(NamedTuple):
    text: str
    message_ends: list[int]  # char offsets into text where a message ended


# transformers' AssistantTracker renders the body of {% generation %}; an always-true `if` keeps the same
# whitespace control (dashes and plus signs stay on the rewritten tags).
_GENERATION = re.compile(r"\{%([-+]?)\s*(end)?generation\s*([-+]?)%\}")

# The sentinel embeds a per-render random nonce, so message text can never contain a valid mark.
_local = threading.local()


def _generation_as_if(m: re.Match[str]) -> str:
    return "{%" + m[1] + (" endif " if m[2] else " if true ") + m[3] + "%}"


def _mark() -> str:
    return _local.sentinel


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _indent(s: str, width: int | str = 4, first: bool = False, blank: bool = False) -> str:
    # jinja2's indent keeps a trailing newline ('{\n'|indent(4, first=True) == '    {\n'); minijinja's drops
    # it, which changes Command-R's tool-call rendering.
    prefix = width if isinstance(width, str) else " " * width
    lines = (s + "\n").splitlines()
    if blank:
        text = ("\n" + prefix).join(lines)
    else:
        text = lines[0] + "".join("\n" + (prefix + line if line else line) for line in lines[1:])
    return prefix + text if first else text


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _one_line(e: BaseException) -> str:
    text = e.message if isinstance(e, minijinja.TemplateError) else str(e)
    return text.strip().splitlines()[0] if text.strip() else type(e).__name__


class ChatTemplate:
    """A compiled chat template; `render` is safe to call from several threads at once."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", **extra_globals: Any) -> None:
        self._env = minijinja.Environment(
            trim_blocks=True,
            lstrip_blocks=True,
            undefined_behavior="lenient",  # jinja2's default Undefined: prints empty, attribute access fails
            pycompat=True,  # str/dict methods (.split, .items, .get, ...) as in Python
            filters={"tojson": _tojson, "indent": _indent},
            globals={
                "raise_exception": _raise_exception,
                "strftime_now": _strftime_now,
                "mark": _mark,
                "bos_token": bos_token,
                "eos_token": eos_token,
                **extra_globals,
            },
        )
        try:
            self._env.add_template("chat", _GENERATION.sub(_generation_as_if, source))
        except Exception as e:
            raise TemplateError(f"chat template does not compile: {_one_line(e)}") from e

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> Rendered:
        # transformers always passes documents (None when absent); templates test `documents is not none`.
        kwargs.setdefault("documents", None)
        sentinel = f"\ue000{secrets.token_hex(8)}\ue001"
        _local.sentinel = sentinel
        try:
            text = self._env.render_template(
                "chat", messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs
            )
        except Exception as e:
            raise TemplateError(_one_line(e)) from e
        finally:
            del _local.sentinel
        pieces = text.split(sentinel)
        ends, offset = [], 0
        for piece in pieces[:-1]:
            offset += len(piece)
            ends.append(offset)
        return Rendered("".join(pieces), ends)
