"""`flare chat` (common/chat_terminal.py) driven through a pseudo-terminal as a person types: given a core it starts
and stops the server itself; two turns (the second reports cached tokens), Ctrl-C during a reply, /save and /load;
against a running server (--base-url): multi-line input, /system, /clear, a wrong API key."""

from __future__ import annotations

import json
import re
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.support.servers import TEST_API_KEY, Server, wait_for_cancellation
from tests.support.scripted_engine import ScriptedStack

pexpect = pytest.importorskip("pexpect")

FLARE = str(Path(sys.executable).with_name("flare"))
PROMPT = ">>> "
USAGE = re.compile(r"\[(\d+) prompt tokens \((\d+) cached\) · (\d+) tokens")
TIMEOUT = 180


def start_chat(*args: str, model: str = "smollm2") -> pexpect.spawn:
    child = pexpect.spawn(FLARE, ["chat", *args], encoding="utf-8", timeout=TIMEOUT, dimensions=(40, 200))
    child.expect(f"chatting with {model}")
    child.expect_exact(PROMPT)
    return child


def turn(child: pexpect.spawn, text: str) -> tuple[int, int, int]:
    """Sends one message; returns the reply's (prompt tokens, cached tokens, completion tokens)."""
    child.sendline(text)
    child.expect(USAGE)
    prompt, cached, completion = (int(g) for g in child.match.groups())
    child.expect_exact(PROMPT)
    return prompt, cached, completion


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


def test_chat_with_a_core(core_dir: Path, tmp_path: Path) -> None:
    child = pexpect.spawn(FLARE, ["chat", str(core_dir), "--max-tokens", "8", "--temperature", "0"],
                          encoding="utf-8", timeout=TIMEOUT, dimensions=(40, 200))
    try:
        child.expect(r"starting .* on port (\d+)")
        health = f"http://127.0.0.1:{child.match.group(1)}/health"
        child.expect("chatting with smollm2")
        child.expect_exact(PROMPT)
        assert answers(health)

        first = turn(child, "Hello! Who are you?")
        assert first[1] == 0 and first[2] == 8
        second = turn(child, "What can you do?")
        assert second[0] > first[0] and second[1] > 0  # the first turn's prompt came from the prefix cache

        # Ctrl-C during a long reply stops it, the session goes on (and the server with it).
        child.sendline("/set max_tokens 2000")
        child.expect_exact("max_tokens = 2000")
        child.expect_exact(PROMPT)
        child.sendline("Write a very long story about a dragon who learns to fly over the sea.")
        child.expect_exact("over the sea.\r\n")  # the terminal's echo of the line
        child.expect(r"\w{3,}")  # the reply has begun
        child.sendintr()
        child.expect_exact("[stopped]")
        child.expect_exact(PROMPT)
        assert answers(health)
        assert wait_for_cancellation(health.removesuffix("/health"), 0)  # the server cancelled the request
        child.sendline("/set max_tokens 8")
        child.expect_exact(PROMPT)

        saved = tmp_path / "conversation.json"
        child.sendline(f"/save {saved}")
        child.expect_exact("saved 6 messages")
        child.expect_exact(PROMPT)
        conversation = json.loads(saved.read_text())
        assert [m["role"] for m in conversation["messages"]] == ["user", "assistant"] * 3
        assert conversation["messages"][0]["content"] == "Hello! Who are you?"
        assert conversation["messages"][5]["content"]  # the stopped reply keeps what came

        child.sendline("/clear")
        child.expect_exact("conversation cleared")
        child.expect_exact(PROMPT)
        child.sendline(f"/load {saved}")
        child.expect_exact("loaded 6 messages")
        child.expect_exact(PROMPT)
        prompt, cached, _ = turn(child, "Thanks!")
        assert prompt > second[0] and cached > first[0]  # the loaded history went with it, mostly cached

        child.sendline("/bye")
        child.expect_exact("stopping the server")
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0
        assert not answers(health)
    finally:
        if child.isalive():
            child.terminate(force=True)


def test_chat_with_a_running_server(server: Server) -> None:
    child = start_chat("--base-url", server.base_url, "--max-tokens", "4")
    try:
        child.sendline('"""Two lines:')
        child.expect_exact("... ")
        child.sendline('first and second."""')
        child.expect(USAGE)
        two_lines = int(child.match.group(1))
        child.expect_exact(PROMPT)
        child.sendline("/clear")
        child.expect_exact(PROMPT)
        one_line = turn(child, "Two lines:")[0]
        assert two_lines > one_line  # both lines went in one message

        # Longer than the default system prompt SmolLM2's template writes when there is none.
        child.sendline("/system " + "You are a pirate captain who sails the seven seas. " * 5)
        child.expect_exact("system prompt set")
        child.expect_exact(PROMPT)
        child.sendline("/clear")
        child.expect_exact(PROMPT)
        assert turn(child, "Two lines:")[0] > one_line  # the system prompt is sent
        child.sendline("/load /nonexistent/file.json")
        child.expect_exact("cannot load")
        child.expect_exact(PROMPT)
        child.sendeof()
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0
    finally:
        if child.isalive():
            child.terminate(force=True)


def test_wrong_api_key_is_a_clear_error(keyed_server: Server) -> None:
    child = pexpect.spawn(FLARE, ["chat", "--base-url", keyed_server.base_url, "--api-key", "wrong-key"],
                          encoding="utf-8", timeout=TIMEOUT)
    child.expect_exact("flare chat: error: missing or wrong API key")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 1
    child = start_chat("--base-url", keyed_server.base_url, "--api-key", TEST_API_KEY, "--max-tokens", "4")
    turn(child, "Hi")
    child.sendline("/bye")
    child.expect(pexpect.EOF)


def test_reasoning_then_the_answer(thinking_stack: ScriptedStack) -> None:
    marker = thinking_stack.engine.script("cli-thinks", "Two and two make four.\n</think>\n\nIt is 4.")
    child = start_chat("--base-url", thinking_stack.base_url, model="qwen3")
    child.sendline(f"{marker}: what is 2 + 2?")
    child.expect_exact("2 + 2?\r\n")
    # Dimmed, on its own line before the answer.
    child.expect_exact("\x1b[2mTwo and two make four.\x1b[0m\r\nIt is 4.\r\n")
    child.expect(USAGE)
    child.sendline("/bye")
    child.expect(pexpect.EOF)
