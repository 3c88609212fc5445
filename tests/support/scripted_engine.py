"""A scripted stand-in for the engine that speaks the real wire (common.protocol over a ZMQ ROUTER), and a real
`flare-frontend` process in front of it.

A 135M model will not produce a tool call, fail halfway, or find its queue full on demand; this engine does. A
test registers a script under a marker string that it puts in its prompt; the engine answers any request whose
prompt holds the marker by streaming the script's reply, token by token, in the real tokenizer's ids, then
failing, rejecting, or finishing as scripted. Requests without a marker get a short default reply.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import zmq
from tokenizers import Tokenizer

from common import protocol as wire
from common.manifest import load_manifest
from tests.support.ports import free_port

STEP_SECONDS = 0.002
DEFAULT_REPLY = "Hello from the scripted engine."


@dataclass
class Script:
    reply: str
    reject: tuple[int, str] | None = None  # (status, message): refuse the request as the engine would
    fail_after: int | None = None  # tokens sent before the request fails with an execution error
    endless: bool = False  # repeat the reply until aborted or out of tokens


@dataclass
class Running:
    identity: bytes
    submit: wire.Submit
    tokens: list[int]
    script: Script
    sent: int = 0


class ScriptedEngine(threading.Thread):
    def __init__(self, core: Path) -> None:
        super().__init__(daemon=True)
        manifest = load_manifest(core)
        self.tokenizer = Tokenizer.from_file(str(core / "tokenizer.json"))
        self.eos = manifest.eos_token_ids[0]
        self.card = wire.ModelCard(manifest.served_names, manifest.checkpoint, manifest.architecture,
                                   manifest.context_limit, manifest.eos_token_ids, manifest.created)
        self.address = f"ipc:///tmp/flare-scripted-{uuid.uuid4().hex[:12]}.sock"
        self.scripts: dict[str, Script] = {}
        self.running: dict[str, Running] = {}
        self.submitted: list[wire.Submit] = []
        self.aborted: list[str] = []
        self._halt = threading.Event()
        self._ready = threading.Event()

    def script(self, marker: str, reply: str, **options: object) -> str:
        self.scripts[marker] = Script(reply, **options)
        return marker

    def submits_with(self, marker: str) -> list[wire.Submit]:
        return [s for s in self.submitted if marker in self.tokenizer.decode(s.prompt, skip_special_tokens=False)]

    def start(self) -> None:
        super().start()
        self._ready.wait(10)

    def stop(self) -> None:
        self._halt.set()
        self.join(5)

    def run(self) -> None:
        context = zmq.Context()
        socket = context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind(self.address)
        self._ready.set()
        frontends: set[bytes] = set()
        last_beat = 0.0
        try:
            while not self._halt.is_set():
                while socket.poll(0):
                    identity, payload = socket.recv_multipart()
                    frontends.add(identity)
                    self._receive(socket, identity, wire.decode_frontend_message(payload))
                for request_id in list(self.running):
                    self._step(socket, self.running[request_id])
                if time.monotonic() - last_beat > 0.5:
                    last_beat = time.monotonic()
                    for identity in frontends:
                        socket.send_multipart([identity, wire.encode(wire.Heartbeat("scripted"))])
                socket.poll(STEP_SECONDS * 1000)
        finally:
            socket.close()
            context.term()

    def _receive(self, socket: zmq.Socket, identity: bytes, message: wire.FrontendMessage) -> None:
        if isinstance(message, wire.Hello):
            socket.send_multipart([identity, wire.encode(wire.Welcome("scripted", self.card, 8, 8, 0.5))])
        elif isinstance(message, wire.Abort):
            for request_id in message.request_ids:
                if self.running.pop(request_id, None) is not None:
                    self.aborted.append(request_id)
        elif isinstance(message, wire.Submit):
            self.submitted.append(message)
            prompt = self.tokenizer.decode(message.prompt, skip_special_tokens=False)
            script = next((s for marker, s in self.scripts.items() if marker in prompt), Script(DEFAULT_REPLY))
            if script.reject is not None:
                socket.send_multipart([identity, wire.encode(wire.Rejected(message.request_id, *script.reject))])
                return
            tokens = self.tokenizer.encode(script.reply, add_special_tokens=False).ids
            self.running[message.request_id] = Running(identity, message, tokens, script)

    def _step(self, socket: zmq.Socket, run: Running) -> None:
        """One token per step; the last step carries the finish, as the engine's does."""
        submit, script = run.submit, run.script
        limit = submit.sampling.max_tokens
        if script.fail_after is not None and run.sent >= script.fail_after:
            self._send(socket, run, [], "error", "scripted failure")
            return
        if run.sent >= len(run.tokens) and not script.endless:
            self._send(socket, run, [self.eos], "stop")
            return
        token = run.tokens[run.sent % len(run.tokens)]
        run.sent += 1
        self._send(socket, run, [token], "length" if run.sent >= limit else None)

    def _send(self, socket: zmq.Socket, run: Running, tokens: list[int], finish: str | None,
              error: str | None = None) -> None:
        submit = run.submit
        k = submit.sampling.logprobs
        logprobs = fake_logprobs(tokens, k) if k is not None and tokens else None
        prompt_logprobs = None
        if submit.sampling.prompt_logprobs is not None and run.sent == 1:
            prompt_logprobs = fake_logprobs(submit.prompt[1:], submit.sampling.prompt_logprobs)
        socket.send_multipart([run.identity, wire.encode(wire.Outputs(
            [submit.request_id], [tokens], [finish], [error], [len(submit.prompt)], [0], [logprobs],
            [prompt_logprobs]))])
        if finish is not None:
            del self.running[submit.request_id]


def fake_logprobs(tokens: list[int], k: int) -> wire.Logprobs:
    """Made-up but well-formed: the chosen token scores -0.5 and leads its k alternatives."""
    return wire.Logprobs(tokens, [-0.5] * len(tokens), [[t + i for i in range(k)] for t in tokens],
                         [[-0.5 - i for i in range(k)] for _ in tokens])


class ScriptedStack:
    """The scripted engine and a real frontend process connected to it."""

    def __init__(self, core: Path, *frontend_args: str) -> None:
        self.core = core
        self.engine = ScriptedEngine(core)
        self.engine.start()
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        frontend = Path(sys.executable).with_name("flare-frontend")
        # A file, not a pipe: a pipe nobody reads would block the frontend once it filled.
        self.log = tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen([str(frontend), "--engine", self.engine.address, "--core", str(core),
                                         "--port", str(self.port), *frontend_args],
                                        stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"flare-frontend exited early:\n{self.log.read()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=1):
                    return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("flare-frontend did not become healthy")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.engine.stop()
        self.log.close()
