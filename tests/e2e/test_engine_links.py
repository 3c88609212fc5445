"""Hostile input on the engine links, through real processes: one `flare run` with a TCP engine address, CURVE keys
and an API key from a file serves every check here, while raw ZeroMQ peers send it junk, oversized frames, invalid
Submits, and connect with the wrong keys (docs/design.md, Trust boundaries)."""

from __future__ import annotations

import asyncio
import math
import os
import stat
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import httpx
import openai
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from common import protocol as wire
from common.links import LinkKeys, frame_limit
from common.manifest import load_manifest
from tests.common.test_dashboard import wait_until
from tests.support.ports import free_port
from tests.support.servers import Server

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
API_KEY = f"key-{uuid.uuid4().hex}"
ANSWER_MS = 3000  # how long a raw peer waits for an answer it should get
SILENCE_MS = 2000  # how long a refused peer is given to get anything at all
STORY = [{"role": "user", "content": "Tell me a long story about the sea."}]


def make_keys(directory: Path) -> LinkKeys:
    subprocess.run([str(BIN / "flare"), "keys", str(directory)], check=True, capture_output=True)
    return LinkKeys.load(directory)


class Stack:
    def __init__(self, core: Path, tmp: Path) -> None:
        self.core = core
        self.keys_dir = tmp / "keys"
        self.keys = make_keys(self.keys_dir)
        key_file = tmp / "api-key"
        key_file.write_text(API_KEY + "\n")
        port = free_port()
        self.address = f"tcp://127.0.0.1:{port}"
        env = {k: v for k, v in os.environ.items() if k != "FLARE_API_KEY"}
        self.server = Server(core, "--engine-keys", str(self.keys_dir), "--api-key-file", str(key_file),
                             engine_address=self.address, env=env)
        self.context = zmq.Context()
        self.model = self.client().models.list().data[0].id

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)

    def peer(self, kind: int = zmq.DEALER, keys: LinkKeys | bool = True, address: str | None = None) -> zmq.Socket:
        """A raw peer of the engine socket: with the deployment's keys (True), other keys, or none (False)."""
        socket = self.context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        if keys is not False:
            (self.keys if keys is True else keys).join(socket)
        socket.connect(address or self.address)
        return socket

    def stop(self) -> None:
        self.context.destroy(linger=0)
        self.server.stop()


@pytest.fixture(scope="module")
def stack(core_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    stack = Stack(core_dir, tmp_path_factory.mktemp("links"))
    yield stack
    stack.stop()


def welcome(socket: zmq.Socket, timeout_ms: int) -> wire.Welcome | None:
    """Say Hello; the Welcome, or None when nothing came back."""
    socket.send(wire.encode(wire.Hello(wire.PROTOCOL_VERSION, f"test-{uuid.uuid4().hex[:6]}")))
    while socket.poll(timeout_ms):
        message = wire.decode_engine_message(socket.recv())
        if isinstance(message, wire.Welcome):
            return message
    return None


def answer(socket: zmq.Socket, request_id: str) -> wire.Rejected | wire.Outputs | None:
    """The first Rejected or Outputs about `request_id`."""
    while socket.poll(ANSWER_MS * 10):
        message = wire.decode_engine_message(socket.recv())
        if isinstance(message, wire.Rejected) and message.request_id == request_id:
            return message
        if isinstance(message, wire.Outputs) and request_id in message.request_ids:
            return message
    return None


class Streams:
    """Honest HTTP streams running in threads while the test does its worst on the engine socket."""

    def __init__(self, stack: Stack, count: int, max_tokens: int) -> None:
        self.model = stack.model
        self.results: list[tuple[str | None, int] | BaseException] = []
        self.started = threading.Barrier(count + 1)
        self.threads = [threading.Thread(target=self._run, args=(stack.client(), max_tokens)) for _ in range(count)]
        for thread in self.threads:
            thread.start()
        try:
            self.started.wait(120)  # every stream has its first token: the requests are live in the engine
        except threading.BrokenBarrierError:
            raise AssertionError(f"the streams did not start: {self.finish()}") from None

    def _run(self, client: openai.OpenAI, max_tokens: int) -> None:
        try:
            tokens, finish, first = 0, None, True
            for chunk in client.chat.completions.create(model=self.model, messages=STORY, max_tokens=max_tokens,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True}):
                if first and chunk.choices and chunk.choices[0].delta.content:
                    first = False
                    self.started.wait(120)
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
            self.results.append((finish, tokens))
        except BaseException as exc:  # the test reports it
            self.results.append(exc)
            self.started.abort()

    def finish(self) -> list[tuple[str | None, int] | BaseException]:
        for thread in self.threads:
            thread.join(300)
        return self.results


def test_junk_on_the_engine_socket_is_dropped_while_streams_finish(stack: Stack) -> None:
    streams = Streams(stack, 1, 64)
    two_frames = stack.peer()
    two_frames.send_multipart([b"first", wire.encode(wire.Hello(wire.PROTOCOL_VERSION, "two"))])
    req = stack.peer(zmq.REQ)  # a REQ socket sends an empty delimiter frame before the message
    req.send(wire.encode(wire.Hello(wire.PROTOCOL_VERSION, "req")))
    undecodable = stack.peer()
    undecodable.send(b"\xc1 this is not MessagePack")
    wrong_type = stack.peer()
    wrong_type.send(wire.encode(wire.Welcome("engine-x", wire.ModelCard(["m"], "c", "a", 1, [0]), 1, 1, 1.0)))
    # A frame over the bound: the engine cuts the sender off instead of buffering it.
    manifest = load_manifest(stack.core)
    oversized = stack.peer()
    monitor = oversized.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    oversized.send(bytes(frame_limit(manifest.context_limit, manifest.vision) + 1))
    assert monitor.poll(ANSWER_MS * 10), "the engine kept the connection of a peer that sent an oversized frame"
    assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
    assert streams.finish() == [("length", 64)]
    assert stack.server.process.poll() is None
    assert welcome(stack.peer(), ANSWER_MS * 10) is not None, "the engine no longer answers after the junk"


def test_invalid_submits_are_rejected_alone(stack: Stack) -> None:
    """Each bad Submit gets its own 400; the honest requests batched beside them finish."""
    streams = Streams(stack, 3, 48)
    peer = stack.peer()
    assert welcome(peer, ANSWER_MS * 10) is not None
    bad = {"logprobs": wire.SamplingParams(max_tokens=8, logprobs=10 ** 6),
           "nan temperature": wire.SamplingParams(max_tokens=8, temperature=math.nan),
           "negative top_p": wire.SamplingParams(max_tokens=8, top_p=-0.5),
           "min_tokens": wire.SamplingParams(max_tokens=8, min_tokens=10 ** 9),
           "top_k past int32": wire.SamplingParams(max_tokens=8, top_k=1 << 31),
           "stop id past the vocabulary": wire.SamplingParams(max_tokens=8, stop_token_ids=[1 << 40])}
    ids = {name: uuid.uuid4().hex for name in bad}
    for name, params in bad.items():
        peer.send(wire.encode(wire.Submit(ids[name], [1, 2, 3, 4], params)))
    ids["message ends"] = uuid.uuid4().hex
    peer.send(wire.encode(wire.Submit(ids["message ends"], [1, 2, 3, 4], wire.SamplingParams(max_tokens=8),
                                      message_ends=[10 ** 6])))
    for name, request_id in ids.items():
        got = answer(peer, request_id)
        assert isinstance(got, wire.Rejected) and got.status == 400, f"{name}: {got}"
    assert streams.finish() == [("length", 48)] * 3


def test_peers_without_the_keys_get_nothing(stack: Stack, tmp_path: Path) -> None:
    """What a frontend, dashboard or stranger without the deployment's keys gets: nothing, on either socket."""
    greeting = welcome(stack.peer(), ANSWER_MS * 10)
    assert greeting is not None  # the deployment's keys: welcomed
    other = make_keys(tmp_path / "other")
    refused = {
        "another deployment's keys": other,
        "no keys": False,
        # The right peer pair, another engine key: the client's check of the engine fails the handshake.
        "another engine key": LinkKeys(other.engine_public, b"", stack.keys.peer_public, stack.keys.peer_secret),
        # The right engine key, another peer pair: the engine's authenticator refuses the handshake.
        "another peer key": LinkKeys(stack.keys.engine_public, b"", other.peer_public, other.peer_secret)}
    peers = {name: stack.peer(keys=keys) for name, keys in refused.items()}
    for peer in peers.values():
        peer.send(wire.encode(wire.Hello(wire.PROTOCOL_VERSION, f"test-{uuid.uuid4().hex[:6]}")))
    subscribers = {name: stack.peer(zmq.SUB, keys=keys, address=greeting.telemetry_address)
                   for name, keys in [("the deployment's keys", True), *refused.items()]}
    for subscriber in subscribers.values():
        subscriber.setsockopt(zmq.SUBSCRIBE, wire.TELEMETRY_METRICS_TOPIC)
    # The engine publishes telemetry twice a second: the keyed subscriber hears it, and by then the others would too.
    assert subscribers.pop("the deployment's keys").poll(ANSWER_MS * 10)
    poller = zmq.Poller()
    for socket in [*peers.values(), *subscribers.values()]:
        poller.register(socket, zmq.POLLIN)
    assert poller.poll(SILENCE_MS) == []


def test_api_key_reaches_children_only_through_their_environment(stack: Stack) -> None:
    supervisor = stack.server.process.pid
    children = [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == supervisor]
    assert len(children) == 2  # the engine and the frontend
    for pid in [supervisor, *children]:
        assert API_KEY.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    assert httpx.get(f"{stack.server.base_url}/v1/models", timeout=30).status_code == 401
    assert httpx.get(f"{stack.server.base_url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"},
                     timeout=30).status_code == 200


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def test_cache_salt_separates_prefixes(stack: Stack) -> None:
    client = stack.client()
    prompt = [{"role": "user", "content": " ".join(f"Item {i} is a {uuid.uuid4().hex[:4]}." for i in range(60))}]

    def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt is not None else {}
        reply = client.chat.completions.create(model=stack.model, messages=prompt, max_tokens=1, extra_body=extra)
        assert reply.usage.prompt_tokens >= 256
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0
    assert cached(None) == 0
    assert cached("tenant-a") > 0
    assert cached(None) > 0
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        cached("")


def test_exposed_engine_address_without_keys_refuses_to_start(core_dir: Path) -> None:
    address = f"tcp://0.0.0.0:{free_port()}"
    for command in ([str(BIN / "flare"), "run", str(core_dir), "--engine-address", address],
                    [str(BIN / "flare-engine"), "--core", str(core_dir), "--listen", address]):
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert done.returncode == 1
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "--engine-keys" in lines[0] and address in lines[0], done.stderr


def test_flare_keys_writes_private_key_files(tmp_path: Path) -> None:
    directory = tmp_path / "keys"
    make_keys(directory)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in directory.iterdir()}
    assert modes == {"engine.secret": 0o600, "peer.secret": 0o600, "engine.public": 0o644, "peer.public": 0o644}
    again = subprocess.run([str(BIN / "flare"), "keys", str(directory)], capture_output=True, text=True)
    assert again.returncode == 1 and "exists" in again.stderr


def test_the_dashboard_follows_an_engine_with_keys(stack: Stack) -> None:
    from common.dashboard.app import Dashboard  # textual loads only for this test

    async def drive() -> None:
        app = Dashboard(wire.telemetry_address(stack.address), stop_requested=lambda: False, keys=stack.keys)
        async with app.run_test(size=(120, 16)) as pilot:
            await wait_until(pilot, lambda: app.view.latest is not None)

    asyncio.run(drive())
