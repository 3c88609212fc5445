"""The chat page (frontend/static/) in a real Chromium (Debian's, driven by Playwright) against a real `flare run`:
a streamed reply, a second turn served from the prefix cache, stop midway, regenerate, reload, the API-key prompt,
a phone-sized screen. With FLARE_SCREENSHOTS=DIR set, the conversation and the settings are saved as PNGs there
(docs/ holds the committed ones)."""

from __future__ import annotations

import base64
import json
import os
import re
import urllib.request
from pathlib import Path

import pytest

from tests.support.servers import TEST_API_KEY, Server, cancellations, wait_for_cancellation
from tests.support.scripted_engine import ScriptedStack

playwright_api = pytest.importorskip("playwright.sync_api")

CHROMIUM = Path("/usr/bin/chromium")
# No network but the page's own server: none of Chromium's background services, updates or sync.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
SHORT = 12  # max tokens of the replies that run to their end
WAIT_MS = 120_000
# Predicates are functions, not expressions: Playwright evaluates an expression with eval, which the page's CSP forbids.
MODEL_SHOWN = "() => document.getElementById('model-name').textContent.startsWith('smollm2')"

# Records every text the last assistant reply shows while a reply streams (the page marks <body> busy meanwhile).
WATCH_REPLY = """() => {
  window.replyTexts = [];
  new MutationObserver(() => {
    const content = document.querySelector('.message.assistant:last-child .content:not(.pending)');
    const text = content ? content.textContent : '';
    if (document.body.classList.contains('busy') && text && text !== window.replyTexts.at(-1)) {
      window.replyTexts.push(text);
    }
  }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
}"""


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.skip("no /usr/bin/chromium (make test installs Debian's chromium)")
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    """A fresh browser context (empty localStorage); a page error fails the test."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    yield page
    context.close()
    assert not errors, errors


def screenshot(page, name: str) -> None:
    if folder := os.environ.get("FLARE_SCREENSHOTS"):
        page.screenshot(path=str(Path(folder) / name))


def open_page(page, server: Server) -> None:
    page.goto(server.base_url + "/")
    page.wait_for_function(MODEL_SHOWN)


def set_settings(page, max_tokens: int, temperature: str = "0", system: str | None = None) -> None:
    page.click("#settings-button")
    page.fill("#max-tokens", str(max_tokens))
    page.eval_on_selector("#temperature", "(slider, value) => { slider.value = value; "
                          "slider.dispatchEvent(new Event('input')); }", temperature)
    if system is not None:
        page.fill("#system", system)


def send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def wait_reply_done(page) -> None:
    page.wait_for_function("() => !document.body.classList.contains('busy') && "
                           "document.querySelector('.message.assistant:last-child .regenerate') !== null")


def last_reply(page):
    return page.locator(".message.assistant").last


def api_reply(server: Server, messages: list[dict], max_tokens: int) -> str:
    body = {"model": "smollm2-135m-instruct", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    request = urllib.request.Request(server.base_url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())["choices"][0]["message"]["content"]


def test_streamed_conversation_kept_across_reload(page, server: Server) -> None:
    open_page(page, server)
    assert page.locator("#drop-zone").is_hidden()  # the default core takes no images
    system = "You are a friendly assistant. Answer briefly."
    set_settings(page, SHORT, system=system)
    page.click("#close-settings")
    page.evaluate(WATCH_REPLY)
    question = "Hello! Who are you?"
    send(page, question)
    wait_reply_done(page)
    first = last_reply(page).locator(".content").text_content()
    seen = page.evaluate("window.replyTexts")
    assert len(seen) >= 2 and seen[-1] == first, seen  # it grew piece by piece while streaming
    assert all(first.startswith(text) for text in seen)
    # What the page shows is what the API answers to the same conversation (greedy).
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    assert first == api_reply(server, messages, SHORT)
    usage = last_reply(page).locator(".usage").text_content()
    assert re.search(rf"\d+ prompt tokens \(\d+ cached\) · {SHORT} tokens · TTFT [\d.]+ s", usage), usage

    send(page, "What can you help me with?")
    wait_reply_done(page)
    usage = last_reply(page).locator(".usage").text_content()
    assert int(re.search(r"\((\d+) cached\)", usage)[1]) > 0, usage  # the first turn's prompt is reused
    screenshot(page, "chat-conversation.png")
    page.click("#settings-button")
    screenshot(page, "chat-settings.png")
    page.click("#close-settings")
    second = last_reply(page).locator(".content").text_content()

    page.reload()
    page.click("#new-chat")
    assert page.locator(".message").count() == 0
    page.locator("#conversations .open", has_text=question).click()
    assert page.locator(".message .content").all_text_contents() == [question, first, "What can you help me with?", second]
    assert page.locator("#system").input_value() == system  # settings are kept too


def test_stop_midway_then_regenerate(page, server: Server) -> None:
    open_page(page, server)
    set_settings(page, 1000)
    page.click("#close-settings")
    cancelled_before = cancellations(server.base_url)
    send(page, "Write a very long story about a dragon who learns to fly over the sea.")
    page.wait_for_function("() => (document.querySelector('.message.assistant:last-child .content:not(.pending)')"
                           "?.textContent.length ?? 0) > 20")
    page.click("#stop")
    page.wait_for_selector(".message.assistant:last-child .stopped")
    assert page.locator("#send").is_visible() and page.locator("#stop").is_hidden()
    assert last_reply(page).locator(".usage").count() == 0
    stopped_text = last_reply(page).locator(".content").text_content()
    assert stopped_text
    assert wait_for_cancellation(server.base_url, cancelled_before)  # the server cancelled the request
    assert last_reply(page).locator(".content").text_content() == stopped_text  # nothing came after the stop
    page.click("#settings-button")
    page.fill("#max-tokens", str(SHORT))
    page.click("#close-settings")
    last_reply(page).locator(".regenerate").click()
    wait_reply_done(page)
    assert last_reply(page).locator(".stopped").count() == 0
    assert f"· {SHORT} tokens ·" in last_reply(page).locator(".usage").text_content()
    assert page.locator(".message").count() == 2  # regenerate replaced the reply, it did not add one


def test_api_key_asked_kept_and_sent(page, keyed_server: Server) -> None:
    page.goto(keyed_server.base_url + "/")  # the page itself loads without the key
    page.wait_for_selector("#key-dialog[open]")
    assert page.locator("#key-error").is_hidden()
    page.fill("#key-input", "wrong-key")
    page.click("#key-save")
    page.wait_for_selector("#key-dialog[open] #key-error:visible")
    page.fill("#key-input", TEST_API_KEY)
    page.click("#key-save")
    page.wait_for_function(MODEL_SHOWN)
    assert page.evaluate("localStorage.getItem('flare.apiKey')") == TEST_API_KEY
    set_settings(page, 4)
    page.click("#close-settings")
    send(page, "Hi")
    wait_reply_done(page)
    assert "· 4 tokens ·" in last_reply(page).locator(".usage").text_content()
    page.reload()  # the stored key is sent at once: no prompt
    page.wait_for_function(MODEL_SHOWN)
    assert page.locator("#key-dialog[open]").count() == 0


def test_phone_sized_screen(browser, server: Server) -> None:
    context = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
    page = context.new_page()
    try:
        open_page(page, server)
        assert page.evaluate("document.documentElement.scrollWidth") <= 390  # nothing wider than the screen
        assert page.locator("#menu").is_visible()
        sidebar = page.locator("#sidebar")
        assert sidebar.bounding_box()["x"] + sidebar.bounding_box()["width"] <= 0  # slid away
        page.click("#menu")
        page.wait_for_function("() => document.getElementById('sidebar').getBoundingClientRect().x >= 0")
        assert page.locator("#new-chat").is_visible()
        page.click("#new-chat")  # closes the list again
        page.wait_for_function("() => document.getElementById('sidebar').getBoundingClientRect().right <= 0")
        assert page.locator("#prompt").is_visible() and page.locator("#send").is_visible()
    finally:
        context.close()


def test_reasoning_shown_apart_from_the_answer(page, thinking_stack: ScriptedStack) -> None:
    marker = thinking_stack.engine.script("page-thinks", "Two and two make four.\n</think>\n\nIt is 4.")
    page.goto(thinking_stack.base_url + "/")
    page.wait_for_function("() => document.getElementById('model-name').textContent === 'qwen3'")
    send(page, f"{marker}: what is 2 + 2?")
    wait_reply_done(page)
    assert last_reply(page).locator(".reasoning .text").text_content() == "Two and two make four."
    assert last_reply(page).locator(".content").text_content() == "It is 4."
    assert re.search(r"· \d+ reasoning ·", last_reply(page).locator(".usage").text_content())


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory):
    """`flare run` of a tiny random Qwen3-VL exported by ignition (tests/support/vision_checkpoint.py)."""
    vision_checkpoint = pytest.importorskip("tests.support.vision_checkpoint", reason="needs the vision checkpoint builder")
    root = tmp_path_factory.mktemp("page-vision")
    vision_checkpoint.build(root / "hf")
    server = Server(vision_checkpoint.export(root / "hf", root / "core"))
    yield server
    server.stop()


def test_images_dropped_for_a_vision_model(page, vision_server: Server, tmp_path: Path) -> None:
    from PIL import Image

    picture = tmp_path / "red.png"
    Image.new("RGB", (64, 48), (200, 30, 30)).save(picture)
    page.goto(vision_server.base_url + "/")
    page.wait_for_function("() => document.getElementById('model-name').textContent.endsWith('· vision')")
    assert page.locator("#drop-zone").is_visible()
    set_settings(page, 4)
    page.click("#close-settings")
    send(page, "What is in the picture?")
    wait_reply_done(page)
    text_only = int(re.match(r"(\d+) prompt", last_reply(page).locator(".usage").text_content())[1])
    page.click("#new-chat")
    # A drop of the file onto the page, as a person drags it there.
    drop = page.evaluate_handle("""(b64) => {
      const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
      const transfer = new DataTransfer();
      transfer.items.add(new File([bytes], 'red.png', {type: 'image/png'}));
      return transfer;
    }""", base64.b64encode(picture.read_bytes()).decode())
    page.dispatch_event("#chat", "drop", {"dataTransfer": drop})
    page.wait_for_selector("#attachments img")
    send(page, "What is in the picture?")
    wait_reply_done(page)
    assert page.locator(".message.user .images img").count() == 1
    usage = last_reply(page).locator(".usage").text_content()
    assert int(re.match(r"(\d+) prompt", usage)[1]) > text_only, usage  # the image's tokens went in
    assert last_reply(page).locator(".error").count() == 0
