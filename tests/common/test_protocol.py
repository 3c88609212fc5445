"""The wire structs: every message round-trips, and the encoding is positional and compact."""

from __future__ import annotations

import msgspec
import pytest

from common import protocol as wire

MESSAGES = [
    wire.Hello(wire.PROTOCOL_VERSION, "frontend-1"),
    wire.Submit("r1", [1, 2, 3], wire.SamplingParams(temperature=0.0, seed=7, max_tokens=5, stop_token_ids=[2]),
                [3], 12.5),
    wire.Submit("r2", [7, 9, 9, 8], wire.SamplingParams(), [4], 1.0,
                images=[wire.ImageInput(bytes(range(32)), 1, [1, 2, 4], b"\0" * 16)]),
    wire.Abort(["r1", "r2"]),
    wire.Goodbye("frontend-1"),
]
REPLIES = [
    wire.Welcome("e", wire.ModelCard(["m"], "ckpt", "llama", 8192, [2], 1), 64, 256, 1.0),
    wire.Outputs(["r1", "r2"], [[5], []], [None, "stop"], [None, None], [3, 4], [0, 0]),
    wire.Rejected("r1", 400, "too long", "context_hint: x"),
    wire.Heartbeat("e", draining=True),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_frontend_messages_round_trip(message: wire.FrontendMessage) -> None:
    assert wire.decode_frontend_message(wire.encode(message)) == message


@pytest.mark.parametrize("message", REPLIES, ids=lambda m: type(m).__name__)
def test_engine_messages_round_trip(message: wire.EngineMessage) -> None:
    assert wire.decode_engine_message(wire.encode(message)) == message


def test_fields_are_positional_behind_the_tag() -> None:
    raw = msgspec.msgpack.decode(wire.encode(wire.Submit("r", [1], wire.SamplingParams(max_tokens=9))))
    assert raw[:3] == ["submit", "r", [1]] and raw[3][5] == 9


def test_a_message_of_the_wrong_direction_is_refused() -> None:
    with pytest.raises(msgspec.ValidationError):
        wire.decode_frontend_message(wire.encode(wire.Heartbeat("e")))


def test_older_peer_without_appended_fields_still_decodes() -> None:
    old = msgspec.msgpack.encode(["submit", "r", [1, 2], [0.0]])
    submit = wire.decode_frontend_message(old)
    assert isinstance(submit, wire.Submit) and submit.message_ends == [] and submit.sampling.temperature == 0.0
