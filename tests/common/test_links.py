"""The engine links' guards (common/links.py): the frame bound fits the largest legitimate messages, drops are logged
at a bounded rate, and which addresses count as reachable from other hosts."""

from __future__ import annotations

import logging
import stat
from pathlib import Path

import pytest

from common import protocol as wire
from common.links import FIXED_FRAME_BYTES, Drops, exposed, exposure_problem, frame_limit, private_ipc_directory
from common.sampling_bounds import MAX_TOP_LOGPROBS
from common.vision import ImageProcessing

CONTEXT = 8192
VISION = ImageProcessing(image_token_id=151655, vision_start_token_id=151652, vision_end_token_id=151653,
                         min_pixels=65536, max_pixels=16777216)


def test_the_bound_fits_a_submit_that_fills_the_context() -> None:
    big = (1 << 32) - 1  # the widest id MessagePack can carry in five bytes
    submit = wire.Submit("r" * 64, [big] * CONTEXT, wire.SamplingParams(max_tokens=1, prompt_logprobs=MAX_TOP_LOGPROBS),
                         message_ends=list(range(1 << 24, (1 << 24) + CONTEXT)))
    assert len(wire.encode(submit)) <= frame_limit(CONTEXT)


def test_the_bound_fits_outputs_with_the_prompt_logprobs_of_a_full_context() -> None:
    context, top = 1 << 17, MAX_TOP_LOGPROBS  # past what the fixed part alone would hold

    def logprobs(tokens: int) -> wire.Logprobs:
        return wire.Logprobs([1 << 31] * tokens, [-1.5e-7] * tokens, [[1 << 31] * top] * tokens,
                             [[-1.5e-7] * top] * tokens)

    outputs = wire.Outputs(["r" * 64], [[1]], [None], [None], [context], [0], [logprobs(1)], [logprobs(context)])
    assert len(wire.encode(outputs)) <= frame_limit(context)


def test_the_bound_fits_images_that_fill_the_context_of_a_vision_core() -> None:
    context, side = 1024, 16 * VISION.merge_size  # images of 16 x 16 merged tokens, four of them
    tokens = VISION.tokens([1, side, side])
    images = [wire.ImageInput(bytes(32), offset, [1, side, side], bytes(4 * side * side * VISION.patch_dim))
              for offset in range(0, context - tokens + 1, tokens)]
    submit = wire.Submit("r", [VISION.image_token_id] * context, wire.SamplingParams(max_tokens=1), images=images)
    assert len(wire.encode(submit)) <= frame_limit(context, VISION) - FIXED_FRAME_BYTES  # the per-token part alone
    assert len(wire.encode(submit)) > frame_limit(context)  # what a text core's bound would cut off


def test_a_flood_of_drops_is_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    drops = Drops(logging.getLogger("flare.test"), "test link")
    with caplog.at_level(logging.WARNING, logger="flare.test"):
        for i in range(10_000):
            drops.drop(b"peer", f"junk {i}")
    assert len(caplog.records) == 1 and "test link" in caplog.records[0].getMessage()
    assert drops.total == 10_000


@pytest.mark.parametrize("address, reachable", [
    ("tcp://127.0.0.1:5555", False), ("tcp://127.3.2.1:5555", False), ("tcp://localhost:5555", False),
    ("tcp://[::1]:5555", False), ("ipc:///run/user/1000/flare/engine.sock", False), ("inproc://x", False),
    ("tcp://0.0.0.0:5555", True), ("tcp://*:5555", True), ("tcp://10.0.0.1:5555", True), ("tcp://eth0:5555", True),
    ("tcp://[::]:5555", True)])
def test_which_addresses_other_hosts_reach(address: str, reachable: bool) -> None:
    assert exposed(address) == reachable
    problem = exposure_problem(address, None, insecure=False)
    assert (problem is not None) == reachable
    if reachable:
        assert "--engine-keys" in problem and "\n" not in problem
        assert exposure_problem(address, None, insecure=True) is None


def test_ipc_sockets_go_in_a_directory_of_their_own_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    directory = private_ipc_directory()
    assert directory.parent == tmp_path and stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert private_ipc_directory() != directory  # a fresh one each run: no stale socket answers
