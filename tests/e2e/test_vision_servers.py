"""Vision-language models end to end, Qwen3-VL and Qwen3.5 (its hybrid text model, its tower without deepstack): a tiny
random checkpoint of each built with transformers' classes and saved with its image processor, exported by ignition
and served by `flare run`; chats with one to three images (PNG, JPEG with an EXIF rotation, WebP, grayscale, RGBA)
give transformers' greedy tokens (processor + generate, fp32) through the real openai and anthropic clients, and their
greedy text through the real ollama client (bare base64 images); a second turn about the same image reuses the cached
prefix (a hybrid's from an exact checkpoint with its state snapshot), a different image does not. Thinking is off
(Qwen3.5's template would open `<think>` otherwise), through each dialect's own switch."""

from __future__ import annotations

import io

import anthropic
import ollama
import openai
import pytest
import torch
from PIL import Image, ImageOps

from tests.support.servers import Server
from tests.support.image_samples import data_url, samples
from tests.support.vision_checkpoint import build, export

MAX_TOKENS = 12
CHATS = {
    "one png": (["png-rgb"], "What is in the picture?"),
    "exif jpeg and webp": (["jpeg-exif6", "webp"], "Describe both images."),
    "gray, rgba and jpeg": (["png-gray", "png-rgba", "jpeg"], "What differs?"),
}


NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}  # OpenAI's; Anthropic's is off by default


# Qwen3.5-MoE's images take Qwen3.5's path (tests/ignition/test_families.py checks its export and tokens in process).
@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_5"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp(f"{request.param}-e2e")
    model, tokenizer, processor = build(root / "hf", seed=1, family=request.param)
    return model, tokenizer, processor, export(root / "hf", root / "core")


@pytest.fixture(scope="module")
def server(checkpoint):
    server = Server(checkpoint[3])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def expected(checkpoint) -> dict[str, tuple[list[int], list[int]]]:
    """transformers' (prompt ids, output ids) of each chat, computed once for the three clients."""
    return {chat: reference(checkpoint, *CHATS[chat]) for chat in CHATS}


def reference(checkpoint, names: list[str], text: str) -> tuple[list[int], list[int]]:
    """transformers: the template, each image placeholder expanded by its grid (as Qwen3VLProcessor does), the
    processor on the upright pictures, greedy generate. Returns (prompt ids, output ids)."""
    model, tokenizer, processor, _ = checkpoint
    pictures = [ImageOps.exif_transpose(Image.open(io.BytesIO(samples()[name][0]))) for name in names]
    messages = [{"role": "user", "content": [*({"type": "image"} for _ in names), {"type": "text", "text": text}]}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    pixels = processor(images=pictures, return_tensors="pt")
    pieces = prompt.split("<|image_pad|>")
    prompt = pieces[0] + "".join("<|image_pad|>" * (int(grid.prod()) // 4) + piece
                                 for grid, piece in zip(pixels["image_grid_thw"], pieces[1:]))
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    inputs["mm_token_type_ids"] = (inputs["input_ids"] == model.config.image_token_id).int()  # what M-RoPE reads
    with torch.no_grad():
        out = model.generate(**inputs, **pixels, max_new_tokens=MAX_TOKENS, do_sample=False)
    return inputs["input_ids"][0].tolist(), out[0, inputs["input_ids"].shape[1]:].tolist()


def openai_content(names: list[str], text: str) -> list[dict]:
    return [*({"type": "image_url", "image_url": {"url": data_url(*samples()[name])}} for name in names),
            {"type": "text", "text": text}]


@pytest.mark.parametrize("chat", sorted(CHATS))
def test_openai_client_gets_transformers_greedy_tokens(expected, server: Server, chat: str) -> None:
    names, text = CHATS[chat]
    prompt_ids, tokens = expected[chat]
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
    response = client.chat.completions.create(
        model="hf", messages=[{"role": "user", "content": openai_content(names, text)}], max_tokens=MAX_TOKENS,
        temperature=0, extra_body={"return_token_ids": True, **NO_THINKING})
    assert response.model_extra["prompt_token_ids"] == prompt_ids
    assert response.choices[0].model_extra["token_ids"] == tokens


@pytest.mark.parametrize("chat", sorted(CHATS))
def test_anthropic_client_gets_transformers_greedy_text(checkpoint, expected, server: Server, chat: str) -> None:
    names, text = CHATS[chat]
    tokens = expected[chat][1]
    client = anthropic.Anthropic(base_url=server.base_url, api_key="none")
    blocks = [{"type": "image", "source": {"type": "base64", "media_type": samples()[name][1],
                                           "data": data_url(*samples()[name]).split(",", 1)[1]}} for name in names]
    message = client.messages.create(model="hf", max_tokens=MAX_TOKENS, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [*blocks, {"type": "text", "text": text}]}])
    tokenizer = checkpoint[1]
    expected_text = tokenizer.decode([t for t in tokens if t not in tokenizer.all_special_ids],
                                     skip_special_tokens=True)
    assert "".join(block.text for block in message.content) == expected_text


@pytest.mark.parametrize("chat", sorted(CHATS))
def test_ollama_client_gets_transformers_greedy_text(checkpoint, expected, server: Server, chat: str) -> None:
    names, text = CHATS[chat]
    tokens = expected[chat][1]
    client = ollama.Client(host=server.base_url)
    reply = client.chat(model="hf", think=False, options={"temperature": 0, "num_predict": MAX_TOKENS}, messages=[
        {"role": "user", "content": text, "images": [samples()[name][0] for name in names]}])
    tokenizer = checkpoint[1]
    assert reply.message.content == tokenizer.decode([t for t in tokens if t not in tokenizer.all_special_ids],
                                                     skip_special_tokens=True)


def test_a_second_turn_about_the_same_image_reuses_its_prefix_and_another_image_does_not(checkpoint,
                                                                                          server: Server) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
    image_token = checkpoint[0].config.image_token_id

    def chat(messages: list[dict]):  # noqa: ANN202 (an openai ChatCompletion)
        return client.chat.completions.create(model="hf", messages=messages, max_tokens=3, temperature=0,
                                              extra_body={"return_token_ids": True, **NO_THINKING})

    question = {"role": "user", "content": "And the colours?"}
    first = chat([{"role": "user", "content": openai_content(["webp-rgba"], "What is this?")}])
    ids = first.model_extra["prompt_token_ids"]
    image_start, image_end = ids.index(image_token), len(ids) - ids[::-1].index(image_token)
    answer = {"role": "assistant", "content": first.choices[0].message.content}
    same = chat([{"role": "user", "content": openai_content(["webp-rgba"], "What is this?")}, answer, question])
    other = chat([{"role": "user", "content": openai_content(["png-la"], "What is this?")}, answer, question])
    assert same.usage.prompt_tokens_details.cached_tokens >= image_end
    assert other.usage.prompt_tokens_details.cached_tokens <= image_start
