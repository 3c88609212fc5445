"""What guards the ZeroMQ links between Flare's processes (docs/design.md, Trust boundaries): a bound on every frame
received, a rate-limited log of what is dropped, CURVE keys for the links, the refusal to expose a TCP link without
them, and a private directory for ipc sockets."""

from __future__ import annotations

import argparse
import hmac
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio
from zmq.auth.thread import ThreadAuthenticator

from common.vision import ImageProcessing

# The largest message a legitimate peer sends is a Submit of a prompt that fills the context (a MessagePack uint32
# takes 5 bytes, and its message ends as many again), or the Outputs of one with prompt logprobs of the top 20
# (about 300 bytes a token); plus, on a vision core, the float32 patches of images filling it. The fixed part is
# what no token count covers: a grammar's text, a full announcement of a large prefix cache.
TEXT_BYTES_PER_TOKEN = 320
FIXED_FRAME_BYTES = 16 << 20
DROP_LOG_INTERVAL = 10.0  # seconds between two log lines about dropped messages of one link
LOOPBACK = re.compile(r"^(127(\.\d{1,3}){3}|localhost|\[?::1\]?)$")
ENGINE_KEYS, PEER_KEYS = "engine", "peer"


def frame_limit(context_limit: int, vision: ImageProcessing | None = None) -> int:
    """The bound of every frame a link of this core receives (ZMQ_MAXMSGSIZE): a peer that sends more is cut off
    before its frame is buffered whole."""
    per_token = TEXT_BYTES_PER_TOKEN
    if vision is not None:  # a placeholder token stands for merge_size² patches of patch_dim float32 values
        per_token += 4 * vision.patch_dim * vision.merge_size ** 2
    return FIXED_FRAME_BYTES + context_limit * per_token


def bound(socket: zmq.Socket, limit: int) -> None:
    socket.setsockopt(zmq.MAXMSGSIZE, limit)


class Drops:
    """Messages a link drops (wrong shape, undecodable), logged at most once every DROP_LOG_INTERVAL with the count
    since the last line: a flood of junk must not fill the log."""

    def __init__(self, log: logging.Logger, link: str) -> None:
        self.log, self.link = log, link
        self.count = 0  # since the last line
        self.total = 0
        self._logged = -DROP_LOG_INTERVAL

    def drop(self, peer: object, why: str) -> None:
        self.count += 1
        self.total += 1
        now = time.monotonic()
        if now - self._logged >= DROP_LOG_INTERVAL:
            self.log.warning("%s: dropped %d message(s) since the last report; the latest from %r: %s", self.link,
                             self.count, peer, why[:200])
            self._logged, self.count = now, 0


class LinkKeyError(Exception):
    pass


@dataclass(frozen=True)
class LinkKeys:
    """CURVE keys of one deployment (z85): the engines' pair (ROUTER, telemetry XPUB, rank 0's step channel) and the
    peers' pair (frontends, dashboards, the other ranks). An engine admits only peers that prove the peer secret;
    a peer talks only to a server that proves the engine secret."""

    engine_public: bytes
    engine_secret: bytes
    peer_public: bytes
    peer_secret: bytes

    @staticmethod
    def load(directory: Path) -> LinkKeys:
        pairs = [_read(directory / f"{name}.{part}", part == "secret")
                 for name in (ENGINE_KEYS, PEER_KEYS) for part in ("public", "secret")]
        return LinkKeys(*pairs)

    def serve(self, socket: zmq.Socket) -> None:
        """Make a binding socket a CURVE server; its context's authenticator (authenticate) admits peers."""
        socket.curve_secretkey = self.engine_secret
        socket.curve_publickey = self.engine_public
        socket.curve_server = True

    def join(self, socket: zmq.Socket) -> None:
        """Make a connecting socket a CURVE client of the engines."""
        socket.curve_secretkey = self.peer_secret
        socket.curve_publickey = self.peer_public
        socket.curve_serverkey = self.engine_public

    def authenticate(self, context: zmq.Context) -> ThreadAuthenticator:
        """Start the context's ZAP handler: the handshake succeeds only for the peer key. Stop it on close."""
        authenticator = ThreadAuthenticator(context, log=logging.getLogger("flare.links"))
        authenticator.start()
        authenticator.configure_curve_callback("*", _PeerKey(self.peer_public))
        return authenticator


class _PeerKey:
    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, _domain: str, key: bytes) -> bool:  # (z85, as the authenticator hands it over)
        return hmac.compare_digest(key, self.public)


def _read(path: Path, secret: bool) -> bytes:
    try:
        if secret and path.stat().st_mode & 0o077:
            raise LinkKeyError(f"{path} is readable by others: chmod 600 it (keys made by `flare keys` are)")
        key = path.read_bytes().strip()
    except OSError as exc:
        raise LinkKeyError(f"cannot read the engine link key {path}: {exc.strerror} (make keys with "
                           f"`flare keys DIR`)") from None
    if len(key) != 40:
        raise LinkKeyError(f"{path} does not hold a z85 CURVE key (40 characters)")
    return key


def write_keys(directory: Path) -> None:
    """`flare keys DIR`: a new deployment's key pairs; DIR is made 0700, secret files 0600. Existing keys are kept
    (replacing them would lock out every process that holds them): the call fails instead."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    for name in (ENGINE_KEYS, PEER_KEYS):
        public, secret = zmq.curve_keypair()
        for part, key, mode in (("secret", secret, 0o600), ("public", public, 0o644)):
            path = directory / f"{name}.{part}"
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            except FileExistsError:
                raise LinkKeyError(f"{path} exists: keys are not replaced (remove them first)") from None
            with os.fdopen(fd, "wb") as file:
                file.write(key + b"\n")


def subscriber(keys: LinkKeys | None, limit: int, *topics: bytes) -> zmq.asyncio.Socket:
    """An asyncio SUB socket for an engine's telemetry, bounded and keyed like every link; connect it."""
    socket = zmq.asyncio.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    bound(socket, limit)
    if keys:
        keys.join(socket)
    for topic in topics:
        socket.setsockopt(zmq.SUBSCRIBE, topic)
    return socket


def add_link_flags(parser: argparse.ArgumentParser, binds: bool = False) -> None:
    """--engine-keys for every process on an engine link; --insecure-engine-link for those that bind one."""
    parser.add_argument("--engine-keys", type=Path, metavar="DIR",
                        help="the deployment's engine link keys, made by `flare keys DIR`: every link runs CURVE")
    if binds:
        parser.add_argument("--insecure-engine-link", action="store_true",
                            help="serve a TCP engine address other hosts can reach without --engine-keys (anyone "
                                 "who reaches it can submit requests)")


def load_keys(directory: Path | None) -> LinkKeys | None:
    return LinkKeys.load(directory) if directory is not None else None


def exposure_problem(address: str, keys: LinkKeys | None, insecure: bool) -> str | None:
    """Why binding `address` is refused: a TCP address other hosts can reach, with no keys to guard it."""
    if keys is not None or insecure or not exposed(address):
        return None
    return (f"{address} is reachable from other hosts and the engine link has no keys: give --engine-keys DIR "
            f"(made by `flare keys DIR`), or --insecure-engine-link to serve it unauthenticated")


def exposed(address: str) -> bool:
    """Whether a ZeroMQ bind address accepts connections from other hosts (any TCP address but a loopback one)."""
    if not address.startswith("tcp://"):
        return False
    host = address[len("tcp://"):].rsplit(":", 1)[0]
    return not LOOPBACK.match(host)


def private_ipc_directory() -> Path:
    """A fresh directory only this user can enter (0700), under $XDG_RUNTIME_DIR when there is one: ipc sockets in
    it cannot be reached, or replaced, by other users of the host."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = runtime if runtime and os.path.isdir(runtime) else tempfile.gettempdir()
    return Path(tempfile.mkdtemp(prefix="flare-", dir=base))
