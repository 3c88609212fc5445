"""Images through every dialect into the wire, and every bad image refused in the dialect's own shape, with the
frontend still serving (a real `flare-frontend` on a Qwen3-VL core exported by ignition, before the scripted
engine, which records what arrives)."""

from __future__ import annotations

import http.server
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest

from common.manifest import load_manifest
from frontend.images.decode import ImageLimits
from frontend.images.prepare import prepare
from tests.support.image_samples import bad_inputs, data_url, encode, picture, samples
from tests.support.scripted_engine import ScriptedStack
from tests.support.vision_checkpoint import build, export

MAX_IMAGES = 3
MAX_BYTES = 200_000


@pytest.fixture(scope="module")
def vision_core(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("qwen3-vl")
    build(root / "hf")
    return export(root / "hf", root / "core")


class PictureServer(http.server.ThreadingHTTPServer):
    """Serves one PNG at /cat.png on localhost: the allowed remote domain."""


@pytest.fixture(scope="module")
def remote_png() -> tuple[str, bytes]:
    data = encode(picture(50, 40, seed=5), "PNG")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path == "/elsewhere.png":  # a redirect could leave the allowed domains: not followed
                self.send_response(302)
                self.send_header("Location", "http://example.invalid/cat.png")
                self.end_headers()
                return
            body = data if self.path == "/cat.png" else bytes(MAX_BYTES + 1)  # /big.png: over the limit
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = PictureServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://localhost:{server.server_address[1]}/cat.png", data
    server.shutdown()


@pytest.fixture(scope="module")
def stack(vision_core: Path):
    stack = ScriptedStack(vision_core, "--max-images", str(MAX_IMAGES), "--max-image-bytes", str(MAX_BYTES),
                          "--allowed-media-domains", "localhost")
    yield stack
    stack.stop()


def chat_body(model: str, urls: list[str], text: str = "Describe both images.") -> dict:
    return {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": [
        *({"type": "image_url", "image_url": {"url": url}} for url in urls), {"type": "text", "text": text}]}]}


def responses_body(model: str, urls: list[str], text: str = "Describe both images.") -> dict:
    return {"model": model, "max_output_tokens": 4, "input": [{"role": "user", "content": [
        *({"type": "input_image", "image_url": url} for url in urls), {"type": "input_text", "text": text}]}]}


def anthropic_body(model: str, urls: list[str], text: str = "Describe both images.") -> dict:
    def block(url: str) -> dict:
        if not url.startswith("data:"):
            return {"type": "image", "source": {"type": "url", "url": url}}
        media_type, payload = url[len("data:"):].split(";base64,", 1)
        return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": payload}}
    return {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": [
        *(block(url) for url in urls), {"type": "text", "text": text}]}]}


DIALECTS = {"chat": ("/v1/chat/completions", chat_body), "responses": ("/v1/responses", responses_body),
            "anthropic": ("/v1/messages", anthropic_body)}


def error_message(dialect: str, payload: dict) -> str:
    if dialect == "anthropic":
        assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error", payload
        return payload["error"]["message"]
    assert set(payload["error"]) == {"message", "type", "param", "code"}, payload
    assert payload["error"]["type"] == "invalid_request_error"
    return payload["error"]["message"]


def post(stack: ScriptedStack, core: Path, dialect: str, urls: list[str], text: str = "Describe both images."
         ) -> httpx.Response:
    path, body = DIALECTS[dialect]
    model = load_manifest(core).served_names[0]
    return httpx.post(stack.base_url + path, json=body(model, urls, text),
                      headers={"anthropic-version": "2023-06-01"} if dialect == "anthropic" else {}, timeout=60)


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
def test_images_reach_the_wire_prepared_and_placed(stack: ScriptedStack, vision_core: Path, dialect: str) -> None:
    settings = load_manifest(vision_core).vision
    sources = [samples()["png-rgba"], samples()["jpeg-exif6"], samples()["webp"]][: 2 if dialect == "chat" else 3]
    marker = f"marker-{dialect}"
    response = post(stack, vision_core, dialect, [data_url(data, media) for data, media in sources], marker)
    assert response.status_code == 200, response.text
    [submit] = stack.engine.submits_with(marker)
    assert len(submit.images) == len(sources)
    for image, (data, _) in zip(submit.images, sources):
        expected = prepare(data, settings, ImageLimits(), "image")
        assert image.identity == expected.identity and image.grid == list(expected.grid)
        assert image.patches == expected.patches.tobytes()
        span = submit.prompt[image.offset: image.offset + expected.tokens]
        assert span == [settings.image_token_id] * expected.tokens
        assert submit.prompt[image.offset - 1] == settings.vision_start_token_id
        assert submit.prompt[image.offset + expected.tokens] == settings.vision_end_token_id
    assert submit.prompt.count(settings.image_token_id) == sum(
        prepare(data, settings, ImageLimits(), "i").tokens for data, _ in sources)


def test_a_remote_image_from_an_allowed_domain_is_fetched(stack: ScriptedStack, vision_core: Path,
                                                          remote_png: tuple[str, bytes]) -> None:
    url, data = remote_png
    response = post(stack, vision_core, "chat", [url], "marker-remote")
    assert response.status_code == 200, response.text
    [submit] = stack.engine.submits_with("marker-remote")
    assert submit.images[0].identity == load_manifest(vision_core).vision.identity(data)


@pytest.mark.parametrize("path, phrase", [("/big.png", f"over {MAX_BYTES} bytes"), ("/elsewhere.png", "HTTP 302")])
def test_remote_images_keep_to_the_size_limit_and_are_not_redirected(stack: ScriptedStack, vision_core: Path,
                                                                     remote_png: tuple[str, bytes], path: str,
                                                                     phrase: str) -> None:
    response = post(stack, vision_core, "chat", [remote_png[0].replace("/cat.png", path)])
    assert response.status_code == 400 and phrase in error_message("chat", response.json())


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
@pytest.mark.parametrize("case", sorted(bad_inputs()))
def test_bad_images_are_400s_in_the_dialects_shape(stack: ScriptedStack, vision_core: Path, dialect: str,
                                                  case: str) -> None:
    url, phrase = bad_inputs()[case]
    response = post(stack, vision_core, dialect, [url])
    assert response.status_code == 400, response.text
    assert phrase in error_message(dialect, response.json())


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
def test_too_many_images_are_refused(stack: ScriptedStack, vision_core: Path, dialect: str) -> None:
    url = data_url(encode(picture(8, 8), "PNG"), "image/png")
    response = post(stack, vision_core, dialect, [url] * (MAX_IMAGES + 1))
    assert response.status_code == 400
    assert f"{MAX_IMAGES + 1} images in one request; this server takes at most {MAX_IMAGES}" in \
        error_message(dialect, response.json())


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_bomb_costs_the_frontend_nothing_and_it_keeps_serving(stack: ScriptedStack, vision_core: Path) -> None:
    url, _ = bad_inputs()["bomb"]
    post(stack, vision_core, "chat", [url])  # warm: the first request loads lazily imported code
    before = rss_bytes(stack.process.pid)
    for _ in range(3):
        assert post(stack, vision_core, "chat", [url]).status_code == 400
    growth = rss_bytes(stack.process.pid) - before
    assert growth < 64 << 20, f"RSS grew by {growth} bytes (decoding would take {20000 * 20000 * 3})"
    good = data_url(encode(picture(30, 30), "PNG"), "image/png")
    for dialect in DIALECTS:
        assert post(stack, vision_core, dialect, [good]).status_code == 200


def test_ollama_show_says_vision(stack: ScriptedStack, vision_core: Path) -> None:
    name = load_manifest(vision_core).served_names[0]
    shown = httpx.post(stack.base_url + "/api/show", json={"model": name}, timeout=30).json()
    assert "vision" in shown["capabilities"]


def test_a_text_only_core_names_itself_when_sent_an_image(core_dir: Path) -> None:
    text_stack = ScriptedStack(core_dir)
    try:
        url = data_url(encode(picture(8, 8), "PNG"), "image/png")
        name = load_manifest(core_dir).served_names[0]
        for dialect in DIALECTS:
            response = post(text_stack, core_dir, dialect, [url])
            assert response.status_code == 400
            assert f"the model '{name}' does not accept images" in error_message(dialect, response.json())
        shown = httpx.post(text_stack.base_url + "/api/show", json={"model": name}, timeout=30).json()
        assert "vision" not in shown["capabilities"]
    finally:
        text_stack.stop()


def test_placeholder_expansion_keeps_message_ends_on_their_tokens() -> None:
    from common.vision import ImageProcessing
    from frontend.images.inputs import expand
    from frontend.images.prepare import PreparedImage

    settings = ImageProcessing(image_token_id=9, vision_start_token_id=8, vision_end_token_id=7, min_pixels=1,
                               max_pixels=1)
    images = [PreparedImage(b"a", (1, 2, 4), np.zeros(0), 2), PreparedImage(b"b", (1, 4, 4), np.zeros(0), 4)]
    ids, ends, offsets = expand([1, 8, 9, 7, 2, 3, 8, 9, 7, 4], [5, 10], images, settings)
    assert ids == [1, 8, 9, 9, 7, 2, 3, 8, 9, 9, 9, 9, 7, 4]
    assert offsets == [2, 8] and ends == [6, 14]
