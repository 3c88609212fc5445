"""The Ollama dialect's request fields as the shared generation's (docs/design.md, Frontends and dialects): `options`
as sampling fields, `format` as a constraint, `think` as the template's `enable_thinking`, bare base64 `images` as
data: URLs, messages as chat messages. The routes are frontend/api/ollama_chat.py."""

from __future__ import annotations

from common.errors import InvalidRequest
from common.protocol import Constraint, SamplingParams
from frontend.api.models import resolve
from frontend.api.openai_chat import past_tool_calls
from frontend.api.params import get_int, get_stop, get_str
from frontend.api.sampling import sampling_params
from frontend.chat.structured import json_constraint
from frontend.images.inputs import content_of, image_part, text_part
from frontend.images.source import base64_data_url
from frontend.model import ServedModel

ROLES = ("system", "user", "assistant", "tool")
# Ollama's option names for the shared sampling fields (frontend/api/sampling.py) where they differ.
OPTION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
                 "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                 "frequency_penalty": "frequency_penalty"}
THINK_LEVELS = ("low", "medium", "high")  # gpt-oss's efforts; any of them turns thinking on


def model_name(model: ServedModel, body: dict) -> str:
    """Ollama names carry a tag; the served core answers to its own names with or without `:latest`."""
    name = get_str(body, "model", required=True)
    return resolve(model, name.removesuffix(":latest") if not model.knows(name) else name)


def options(body: dict) -> dict:
    value = body.get("options")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequest("'options' must be an object", param="options")
    return value


def sampling(model: ServedModel, options_: dict, prompt_len: int) -> SamplingParams:
    """Options Ollama documents for sampling; its runtime options (num_thread, num_gpu, ...) have no meaning here
    and, as Ollama does with options that do not apply, are ignored. `num_ctx` narrows the window the prompt and the
    reply share; past the core's context it is a 400."""
    limit = model.manifest.context_limit
    window = get_int(options_, "num_ctx", None, 1)
    if window is not None and window > limit:
        raise InvalidRequest(f"'options.num_ctx' ({window}) is over this model's context of {limit} tokens",
                             param="options")
    # num_predict: -1 is "until the end", -2 "until the context is full"; both are Flare's absent max tokens.
    predict = get_int(options_, "num_predict", None, -2, 1 << 31)
    if predict == 0:
        raise InvalidRequest("'num_predict' must be positive, -1 or -2", param="options")
    fields = {ours: options_[theirs] for theirs, ours in OPTION_FIELDS.items() if theirs in options_}
    return sampling_params(model, fields, prompt_len, predict if predict and predict > 0 else None, context=window)


def stops(options_: dict) -> list[str]:
    return get_stop(options_, "stop")


def output_format(body: dict) -> Constraint | None:
    """`format`: "json" (any JSON object) or a JSON schema; "" is plain text. Validated by the grammar engine (run on
    the worker pool)."""
    value = body.get("format")
    if value is None or value == "":
        return None
    if value == "json":
        return json_constraint({"type": "object"}, "format")
    if isinstance(value, dict):
        return json_constraint(value, "format")
    raise InvalidRequest('\'format\' must be "json" or a JSON schema object', param="format")


def thinking(body: dict, model: ServedModel) -> bool | None:
    """`think`: True or an effort level turns thinking on, False off, absent leaves the template's default. A model
    that cannot think refuses it, as Ollama does."""
    value = body.get("think")
    if value is None:
        return None
    if value in THINK_LEVELS:
        value = True
    if not isinstance(value, bool):
        raise InvalidRequest(f"'think' must be a boolean or one of {list(THINK_LEVELS)}", param="think")
    if value and not model.reasons:
        raise InvalidRequest(f"'{model.name}' does not support thinking", param="think")
    return value


def template_args(model: ServedModel, think: bool | None) -> dict:
    return {"enable_thinking": think} if model.reasons and think is not None else {}


def image_parts(value: object, where: str) -> list[dict]:
    """`images` (at `where`): base64 strings, each a PNG, JPEG or WebP image."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(image, str) for image in value):
        raise InvalidRequest(f"{where} must be a list of base64 strings", param="images")
    return [image_part(base64_data_url(image, f"{where}[{i}]")) for i, image in enumerate(value)]


def user_content(text: str, images: list[dict]) -> str | list[dict]:
    """Images before the text, as Ollama places them."""
    return content_of([*images, text_part(text)])


def chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise InvalidRequest("'messages' must be a list", param="messages")
    result = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise InvalidRequest(f"{where}.role must be one of {list(ROLES)}", param="messages")
        role, content = message["role"], message.get("content") or ""
        if not isinstance(content, str):
            raise InvalidRequest(f"{where}.content must be a string", param="messages")
        images = image_parts(message.get("images"), f"{where}.images")
        if images and role != "user":
            raise InvalidRequest(f"{where}: only user messages carry images", param="messages")
        converted = {"role": role, "content": user_content(content, images)}
        if role == "assistant" and message.get("tool_calls"):
            converted["tool_calls"] = past_tool_calls(message["tool_calls"], where)
        if role == "assistant" and isinstance(message.get("thinking"), str) and message["thinking"]:
            converted["reasoning_content"] = message["thinking"]  # what reasoning templates (Qwen3) render back
        if role == "tool" and isinstance(message.get("tool_name"), str):
            converted["name"] = message["tool_name"]
        result.append(converted)
    return result
