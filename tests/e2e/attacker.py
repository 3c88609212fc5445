"""An attacker beside the soak (`python -m tests.e2e.soak --attack`; docs/design.md, Trust boundaries): it cycles
through attack kinds, each for a window of ATTACK_SECONDS followed by QUIET_SECONDS of quiet, and records per kind
what it sent, what came back, and the windows, so that the soak can tell how honest clients fared during each.

Alone, `python -m tests.e2e.attacker --core DIR` starts a server of one frontend and one engine, sends each kind one
request at a time for a window while a client probes /health every 10 ms, and prints how long the probes took:
whether one hostile request in flight stalls the frontend for everyone else.

The kinds: malformed ZeroMQ frames on the engine's own socket (two frames, one frame of the wrong message type,
undecodable bytes, a frame over the link's bound), a body over --body-limit, a prompt of many MiB, bodies trickled a
byte at a time, grammars past their bounds (chained rules, counted repetition, a 5,000-branch anyOf), a flood of stop
strings, an Authorization header that is not UTF-8, and cross-origin text/plain POSTs a web page could send.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import zmq

from tests.support.servers import Server

from common import protocol as wire
from common.supervisor import replica_address
from common.links import frame_limit
from common.manifest import load_manifest

ATTACK_SECONDS = 5.0
QUIET_SECONDS = 3.0
BODY_LIMIT = 8 << 20  # the soak's server runs with this --body-limit under --attack
BODY_TIMEOUT = 5.0  # and this --body-timeout
TRICKLERS = 4
HELLO = [{"role": "user", "content": "Hi"}]


def chained_rules(count: int) -> str:
    return "\n".join(["start: r0", *(f'r{i}: "a" r{i + 1}' for i in range(count)), f'r{count}: "b"'])


class Attacker:
    def __init__(self, base_url: str, engine_addresses: list[str], core: Path, api_key: str, model: str,
                 paused: threading.Event) -> None:
        self.base_url, self.engine_addresses, self.api_key, self.model = base_url, engine_addresses, api_key, model
        self.paused = paused  # set during the soak's overload bursts: attack windows stay out of them
        self.port = urlsplit(base_url).port
        self.context = zmq.Context()
        manifest = load_manifest(core)
        self.frame_limit = frame_limit(manifest.context_limit, manifest.vision)
        self.http = httpx.Client(base_url=base_url, timeout=120, headers={"Authorization": f"Bearer {api_key}"})
        chat = {"model": model, "messages": HELLO, "max_tokens": 4}
        posts = {
            "body over --body-limit (8 MiB + 1)": b"{" + b" " * BODY_LIMIT + b"}",
            "prompt of 6 MiB of characters": json.dumps({**chat, "messages": [{"role": "user",
                                                                               "content": "a " * (3 << 20)}]}),
            "grammar of 3,000 chained rules": json.dumps({**chat, "structured_outputs": {
                "grammar": chained_rules(3000)}}),
            "regex (a{1000}){1000}": json.dumps({**chat, "structured_outputs": {"regex": "(a{1000}){1000}"}}),
            "JSON schema, anyOf of 5,000 branches": json.dumps({**chat, "structured_outputs": {
                "json": {"anyOf": [{"const": i} for i in range(5000)]}}}),
            "500,000 stop strings": json.dumps({**chat, "stop": [f"s{i}" for i in range(500_000)]}),
        }
        self.kinds: dict[str, Callable[[], str]] = {
            **{kind: (lambda body=body: self.post(body)) for kind, body in posts.items()},
            "trickled bodies (4 at once)": self.trickle,
            "non-UTF-8 Authorization": self.bad_authorization,
            "cross-origin text/plain POST": lambda: self.post(json.dumps(chat), {
                "Origin": "http://attacker.example", "Content-Type": "text/plain"}),
            "zmq: two frames": lambda: self.zmq_junk([b"first", wire.encode(wire.Hello(wire.PROTOCOL_VERSION, "x"))]),
            "zmq: one frame, wrong message type": lambda: self.zmq_junk([wire.encode(
                wire.Welcome("engine-x", wire.ModelCard(["m"], "c", "a", 1, [0]), 1, 1, 1.0))]),
            "zmq: undecodable bytes": lambda: self.zmq_junk([b"\xc1 this is not MessagePack"]),
            "zmq: frame over the link's bound": self.zmq_oversized,
        }
        self.sent: Counter[str] = Counter()
        self.responses: dict[str, Counter[str]] = {kind: Counter() for kind in self.kinds}
        self.windows: list[tuple[str, float, float]] = []
        self.lock = threading.Lock()
        self.cycled = threading.Event()  # every kind has run once: the soak's warm-up includes that

    def run(self, until: float) -> None:
        while time.monotonic() + ATTACK_SECONDS < until:
            for kind, attack in self.kinds.items():
                if time.monotonic() + ATTACK_SECONDS >= until:
                    break
                while self.paused.is_set():
                    time.sleep(0.2)
                start = time.monotonic()
                while time.monotonic() < start + ATTACK_SECONDS:
                    try:
                        response = attack()
                    except (httpx.HTTPError, OSError) as exc:
                        response = f"client error {type(exc).__name__}"
                    with self.lock:
                        self.sent[kind] += 1 if kind != "trickled bodies (4 at once)" else TRICKLERS
                        self.responses[kind][response] += 1
                self.windows.append((kind, start, time.monotonic()))
                time.sleep(QUIET_SECONDS)
            self.cycled.set()
        self.context.destroy(linger=0)
        self.http.close()

    def peer(self, address: str) -> zmq.Socket:
        peer = self.context.socket(zmq.DEALER)
        peer.setsockopt(zmq.LINGER, 0)
        peer.connect(address)
        return peer

    def zmq_junk(self, frames: list[bytes]) -> str:
        """Send frames to every engine as a raw DEALER peer: each should drop them without a word, then welcome the
        same peer's Hello (which proves the junk reached a live engine)."""
        answers = []
        for address in self.engine_addresses:
            peer = self.peer(address)
            peer.send_multipart(frames)
            answered = peer.poll(300)
            name = f"attacker-{uuid.uuid4().hex[:8]}"
            peer.send(wire.encode(wire.Hello(wire.PROTOCOL_VERSION, name)))
            welcomed = peer.poll(10_000) and isinstance(wire.decode_engine_message(peer.recv()), wire.Welcome)
            peer.send(wire.encode(wire.Goodbye(name)))
            peer.close()
            answers.append(f"{'answered' if answered else 'dropped'}, {'Welcome' if welcomed else 'NO Welcome'} "
                           "to the next Hello")
        return ",".join(sorted(set(answers)))

    def zmq_oversized(self) -> str:
        answers = []
        for address in self.engine_addresses:
            peer = self.peer(address)
            monitor = peer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            peer.send(bytes(self.frame_limit + 1))
            answers.append("peer cut off" if monitor.poll(10_000) else "peer kept")
            peer.disable_monitor()
            monitor.close()
            peer.close()
        return ",".join(sorted(set(answers)))

    def post(self, body: str | bytes, headers: dict[str, str] | None = None) -> str:
        response = self.http.post("/v1/chat/completions", content=body,
                                  headers=headers or {"Content-Type": "application/json"})
        return str(response.status_code)

    def raw(self, sock: socket.socket) -> str:
        return sock.recv(65536).split(b" ", 2)[1].decode() or "closed"

    def trickle(self) -> str:
        """Bodies announced at 1 MiB that arrive a byte every half second: each should end in a 408."""
        socks = [socket.create_connection(("127.0.0.1", self.port), timeout=60) for _ in range(TRICKLERS)]
        for sock in socks:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                         b"\r\nAuthorization: Bearer " + self.api_key.encode() + b"\r\nContent-Length: 1048576"
                         b"\r\n\r\n{")
            sock.setblocking(False)
        deadline = time.monotonic() + BODY_TIMEOUT * 3
        while time.monotonic() < deadline:
            time.sleep(0.5)
            try:
                for sock in socks:
                    sock.send(b" ")
            except OSError:  # the server answered and closed
                break
        answers = []
        for sock in socks:
            sock.setblocking(True)
            answers.append(self.raw(sock))
            sock.close()
        return ",".join(sorted(set(answers)))

    def bad_authorization(self) -> str:
        body = json.dumps({"model": self.model, "messages": HELLO, "max_tokens": 2}).encode()
        with socket.create_connection(("127.0.0.1", self.port), timeout=60) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                         b"\r\nAuthorization: Bearer \xff\xfe" + self.api_key.encode() + b"\r\nConnection: close"
                         b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            return self.raw(sock)


def overlaps(start: float, end: float, windows: list[tuple[float, float]]) -> bool:
    return any(start < w_end and w_start < end for w_start, w_end in windows)


def latency(timings: list[tuple[float, float, str]]) -> str:
    """Median / p99 in ms of the honest requests that finished, and how many."""
    times = sorted(1000 * (end - start) for start, end, outcome in timings if outcome.endswith(": finished"))
    if not times:
        return "no finished requests"
    p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
    return f"{statistics.median(times):.0f} / {p99:.0f} (n={len(times)})"


def worst(probes: list[tuple[float, float]]) -> str:
    """The slowest /health answer in ms of (sent, seconds) probes, and how many."""
    return f"{1000 * max(seconds for _, seconds in probes):.0f} (n={len(probes)})" if probes else "no probes"


def report(attacker: Attacker, timings: list[tuple[float, float, str]], bursts: list[tuple[float, float]],
           warm: float, probes: list[tuple[float, float]]) -> tuple[str, dict[str, bool]]:
    """The Markdown table of the attack kinds against the honest requests, and the checks: no 5xx to the attacker,
    honest requests finished during every kind, none failed with a 5xx outside the bursts or a dropped connection.
    Latencies count the honest requests sent after the warm-up (which ends at `warm`: before it, the first long
    prompt is prefilled from scratch, where later ones find it cached), outside the overload bursts; the slowest
    five are listed with the attacks beside them. `probes`: (sent, seconds) of /health probes, the slowest of those
    after the warm-up and outside the bursts shown for each kind and for the quiet windows."""
    honest = [t for t in timings if t[0] >= warm and not overlaps(t[0], t[1], bursts)]
    attacked = [(start, end) for _, start, end in attacker.windows]
    probes = [(sent, seconds) for sent, seconds in probes
              if sent >= warm and not overlaps(sent, sent + seconds, bursts)]
    baseline = latency([t for t in honest if not overlaps(t[0], t[1], attacked)])
    quiet_probes = worst([p for p in probes if not overlaps(p[0], p[0] + p[1], attacked)])
    rows = ["| attack | sent: responses | server still serving (honest finished / failed) | honest latency during it, "
            "median / p99 ms | slowest /health during it, ms | baseline (quiet windows): latency median / p99, "
            "slowest /health, ms |", "|---|---|---|---|---|---|"]
    server_errors, starved = {}, []
    for kind, counts in attacker.responses.items():
        windows = [(start, end) for k, start, end in attacker.windows if k == kind]
        during = [t for t in timings if overlaps(t[0], t[1], windows)]
        finished = sum(outcome.endswith(": finished") for _, _, outcome in during)
        failed = sum(outcome.startswith("5") and "burst" not in outcome or outcome == "connection error"
                     for _, _, outcome in during)
        server_errors |= {f"{kind}: {r}": n for r, n in counts.items() if r.startswith("5") or r.startswith("client")}
        if windows and (finished == 0 or failed):
            starved.append(kind)
        responses = ", ".join(f"{r} ×{n}" for r, n in counts.most_common())
        serving = f"{'yes' if finished and not failed else 'NO'} ({finished} / {failed})" if windows else "not run"
        health = worst([p for p in probes if overlaps(p[0], p[0] + p[1], windows)])
        rows.append(f"| {kind} | {attacker.sent[kind]}: {responses} | {serving} | "
                    f"{latency([t for t in honest if t in during])} | {health} | {baseline}, {quiet_probes} |")
    origin = min(start for start, _, _ in timings)
    slowest = sorted((t for t in honest if t[2].endswith(": finished")), key=lambda t: t[0] - t[1])[:5]
    for start, end, outcome in slowest:
        kinds = sorted({k for k, w_start, w_end in attacker.windows if start < w_end and w_start < end})
        rows.append(f"slow honest request: {outcome} from {start - origin:.0f} s for {1000 * (end - start):.0f} ms, "
                    f"beside {', '.join(kinds) or 'no attack'}")
    checks = {f"no 5xx or dropped connection for the attacker ({server_errors or 'none'})": not server_errors,
              f"honest requests finished and none failed during every attack kind ({starved or 'all'})": not starved}
    return "\n".join(rows), checks


def probed(base_url: str, until: float) -> list[float]:
    """Seconds of /health probes sent every 10 ms until `until`."""
    times = []
    with httpx.Client(timeout=60) as client:
        while time.monotonic() < until:
            sent = time.monotonic()
            client.get(f"{base_url}/health")
            times.append(time.monotonic() - sent)
            time.sleep(max(0.0, 0.01 - (time.monotonic() - sent)))
    return times


def health_while_attacked(core: Path) -> str:
    """The Markdown table of /health probe times during each kind, one hostile request at a time, and with none."""
    api_key = "attacker-key"
    server = Server(core, "--body-limit", str(BODY_LIMIT), "--body-timeout", str(BODY_TIMEOUT),
                    env={**os.environ, "FLARE_API_KEY": api_key})
    try:
        model = httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": f"Bearer {api_key}"}
                          ).json()["data"][0]["id"]
        address = replica_address(server.engine_address, 0, 1)
        attacker = Attacker(server.base_url, [address], core, api_key, model, threading.Event())
        rows = ["| attack (one request at a time) | sent: responses | /health probes | median ms | slowest ms |",
                "| --- | --- | --- | --- | --- |"]
        for kind, attack in [("none", None), *attacker.kinds.items()]:
            until = time.monotonic() + ATTACK_SECONDS
            results: Counter[str] = Counter()

            def send(attack: Callable[[], str] | None = attack) -> None:
                while attack is not None and time.monotonic() < until:
                    results[attack()] += 1
            sender = threading.Thread(target=send)
            sender.start()
            times = probed(server.base_url, until)
            sender.join()
            answers = ", ".join(f"{r} ×{n}" for r, n in results.most_common()) or "-"
            rows.append(f"| {kind} | {sum(results.values())}: {answers} | {len(times)} | "
                        f"{1000 * statistics.median(times):.1f} | {1000 * max(times):.1f} |")
        attacker.context.destroy(linger=0)
        return "\n".join(rows)
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.e2e.attacker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--core", type=Path, required=True)
    print(health_while_attacked(parser.parse_args(argv).core))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
