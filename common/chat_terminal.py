"""`flare chat [--base-url URL | CORE]`: a terminal chat like `ollama run` (README "Chat").

Replies stream as they come (reasoning dimmed, apart from the answer), with their usage after them; Ctrl-C stops a
reply and keeps the session; `\"\"\"` opens and closes a multi-line message; slash commands manage the session.
Given a core instead of a URL, it starts `flare run CORE` (the supervisor, common/supervisor.py) on a free port as a child,
with its log in a file, and stops it on the way out.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from common.api_keys import ApiKeyError, add_api_key_flags, api_key, key_environment
from common.chat_client import ChatError, ChatServer, Conversation, Usage
from common.ranks import free_port
from common.supervisor import READY_TIMEOUT, spawn, wait_ready

HELP = """commands:
  /system [TEXT]     show or set the system prompt (an empty TEXT clears it)
  /set temperature X | /set max_tokens N
  /clear             forget the conversation (the system prompt stays)
  /save FILE         write the conversation to FILE (JSON)
  /load FILE         read a conversation /save wrote
  /bye               leave (so does Ctrl-D)
  \"\"\"              start or end a message of several lines
Ctrl-C stops a reply."""

DIM, RESET = "\033[2m", "\033[0m"
SETTINGS = {"temperature": float, "max_tokens": int}


def read_message(prompt: str = ">>> ", more: str = "... ") -> str:
    """One message; a line starting with \"\"\" goes on until a line ending with \"\"\". EOFError at Ctrl-D."""
    line = input(prompt)
    if not line.startswith('"""'):
        return line
    text = line[3:]
    if len(text) >= 3 and text.endswith('"""'):  # the whole message on the opening line
        return text[:-3]
    lines = [text]
    while not (line := input(more)).endswith('"""'):
        lines.append(line)
    lines.append(line[:-3])
    return "\n".join(lines).strip("\n")


class Session:
    """The conversation, the sampling settings, and the server they go to."""

    def __init__(self, server: ChatServer, model: str, conversation: Conversation, settings: dict) -> None:
        self.server = server
        self.model = model
        self.conversation = conversation
        self.settings = settings
        self.style = (DIM, RESET) if sys.stdout.isatty() else ("", "")

    def say(self, text: str) -> None:
        print(f"{self.style[0]}{text}{self.style[1]}", flush=True)

    def reply(self, text: str) -> None:
        """Sends `text`, streams the reply; Ctrl-C stops it and keeps what came. A refusal leaves no turn behind."""
        self.conversation.messages.append({"role": "user", "content": text})
        body = {"model": self.model, "messages": self.conversation.request_messages(),
                **{name: value for name, value in self.settings.items() if value is not None}}
        reasoning, content, usage, finish = "", "", None, None
        dim, reset = self.style
        stream = self.server.stream(body)
        try:
            for delta in stream:
                if delta.reasoning:
                    print((dim if not reasoning else "") + delta.reasoning, end="", flush=True)
                    reasoning += delta.reasoning
                if delta.content:
                    if reasoning and not content:
                        print(reset)  # the reasoning ends on its own line
                    print(delta.content, end="", flush=True)
                    content += delta.content
                finish = delta.finish_reason or finish
                usage = delta.usage or usage
        except KeyboardInterrupt:
            stream.close()  # closes the connection: the server cancels the request
            print(reset)
            self.say("[stopped]")
        except ChatError as exc:
            stream.close()
            print(reset)
            self.say(f"error: {exc}")
            if not content and not reasoning:
                self.conversation.messages.pop()
                return
        else:
            print(reset if reasoning and not content else "")
            self.say(f"[{usage}{', cut at max_tokens' if finish == 'length' else ''}]" if isinstance(usage, Usage)
                     else "[no usage reported]")
        self.conversation.messages.append({"role": "assistant", "content": content,
                                           **({"reasoning_content": reasoning} if reasoning else {})})

    def command(self, line: str) -> bool:
        """Runs a slash command; False when it is /bye."""
        name, _, argument = line.partition(" ")
        argument = argument.strip()
        if name in ("/bye", "/exit"):
            return False
        if name == "/system":
            if argument or line.startswith("/system "):
                self.conversation.system = argument
                self.say("system prompt set" if argument else "system prompt cleared")
            else:
                self.say(f"system prompt: {self.conversation.system!r}")
        elif name == "/clear":
            self.conversation.messages.clear()
            self.say("conversation cleared")
        elif name in ("/save", "/load") and not argument:
            self.say(f"{name} needs a file name")
        elif name == "/save":
            try:
                self.conversation.save(Path(argument).expanduser())
                self.say(f"saved {len(self.conversation.messages)} messages to {argument}")
            except OSError as exc:
                self.say(f"cannot save: {exc}")
        elif name == "/load":
            try:
                self.conversation = Conversation.load(Path(argument).expanduser())
                self.say(f"loaded {len(self.conversation.messages)} messages from {argument}")
            except (OSError, ValueError) as exc:
                self.say(f"cannot load: {exc}")
        elif name == "/set":
            self.set(argument)
        else:
            self.say(HELP if name in ("/help", "/?") else f"unknown command {name}; /help lists them")
        return True

    def set(self, argument: str) -> None:
        key, _, value = argument.partition(" ")
        if key not in SETTINGS:
            self.say(f"/set takes {' or '.join(SETTINGS)}")
            return
        try:
            self.settings[key] = SETTINGS[key](value)
        except ValueError:
            self.say(f"{key} must be a number, got {value!r}")
            return
        self.say(f"{key} = {self.settings[key]}")

    def loop(self) -> None:
        self.say(f"chatting with {self.model}; /help lists commands, Ctrl-D or /bye leaves")
        while True:
            try:
                text = read_message()
            except KeyboardInterrupt:
                print()
                self.say("(Ctrl-D or /bye leaves)")
                continue
            except EOFError:
                print()
                return
            if text.startswith("/"):
                if not self.command(text):
                    return
            elif text.strip():
                self.reply(text)


def start_server(core: Path, api_key: str | None) -> tuple[subprocess.Popen, str]:
    """`flare run CORE` on a free port, its output in a log file; returns once it answers /health."""
    port = free_port()
    log_fd, log_path = tempfile.mkstemp(prefix="flare-chat-", suffix=".log")
    print(f"flare chat: starting {core} on port {port} (log: {log_path})", file=sys.stderr, flush=True)
    # The key travels in the environment, never on a command line (common/api_keys.py).
    process = spawn(["common.cli", "run", str(core), "--port", str(port)], log_fd, key_environment(api_key))
    os.close(log_fd)
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", {"flare run": process}, READY_TIMEOUT)
    except (RuntimeError, KeyboardInterrupt) as exc:
        stop_server(process)
        tail = Path(log_path).read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"the server did not start ({exc or 'interrupted'}); its log ends:\n" + "\n".join(tail))
    return process, f"http://127.0.0.1:{port}"


def stop_server(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)  # the supervisor drains its frontends and engine, then exits
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def chat(args: argparse.Namespace) -> int:
    if args.core is not None and args.base_url is not None:
        print("flare chat: error: give a core or --base-url, not both", file=sys.stderr)
        return 2
    try:
        key = api_key(args)
    except ApiKeyError as exc:
        print(f"flare chat: error: {exc}", file=sys.stderr)
        return 2
    # Ctrl-C stops a reply even when this process was started with SIGINT ignored (as a shell without job
    # control starts background commands, and what they start inherits): Python then installs no handler of its own.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        import readline  # noqa: F401  (input() gains line editing and a history of this session's lines)
    except ImportError:
        pass
    process = None
    try:
        if args.core is not None:
            process, base_url = start_server(args.core, key)
        else:
            base_url = args.base_url or "http://127.0.0.1:8000"
        server = ChatServer(base_url, key)
        model = args.model or server.model()
        settings = {"temperature": args.temperature, "max_tokens": args.max_tokens}
        Session(server, model, Conversation(args.system or ""), settings).loop()
        return 0
    except (ChatError, RuntimeError) as exc:
        print(f"flare chat: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # while the server starts or the model is asked for
        return 130
    finally:
        if process is not None:
            print("flare chat: stopping the server", file=sys.stderr, flush=True)
            stop_server(process)


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("chat", help="chat with a model in the terminal")
    parser.add_argument("core", type=Path, nargs="?", help="a core to serve for this chat (started and stopped here)")
    parser.add_argument("--base-url", help="a running server (default http://127.0.0.1:8000)")
    add_api_key_flags(parser, "the server's API key (default: --api-key-file, else $FLARE_API_KEY)")
    parser.add_argument("--model", help="the model name to send (default: the server's)")
    parser.add_argument("--system", help="the system prompt")
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--max-tokens", type=int)
