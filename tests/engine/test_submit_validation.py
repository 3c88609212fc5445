"""The engine checks every Submit itself (engine/core.py `_validate`, common/sampling_bounds.py): a value no step can
hold is refused alone with a 400, before planning, and the request beside it is admitted. The real Engine on inproc
sockets (tests/engine/test_engine_loop.py's), without a model."""

from __future__ import annotations

import math

import pytest

from common import protocol as wire
from common.vision import ImageProcessing
from engine.admission import image_problem
from tests.engine.test_engine_loop import make_engine, submit

VOCAB = 1000  # make_engine's


@pytest.mark.parametrize("settings", [
    {"temperature": math.nan}, {"temperature": math.inf}, {"temperature": -0.1}, {"temperature": 101.0},
    {"top_p": -0.5}, {"top_p": 0.0}, {"top_p": math.nan}, {"min_p": 1.5}, {"top_k": -1}, {"top_k": 1 << 31},
    {"presence_penalty": 3.0}, {"frequency_penalty": -math.inf}, {"repetition_penalty": 0.0},
    {"seed": 1 << 63}, {"min_tokens": 10 ** 9}, {"min_tokens": -1}, {"logprobs": 10 ** 6}, {"logprobs": -1},
    {"prompt_logprobs": 21}, {"stop_token_ids": [VOCAB]}, {"stop_token_ids": [-1]}])
def test_a_bad_setting_is_refused_alone(settings: dict) -> None:
    engine, _executor, dealer = make_engine()
    dealer.send(wire.encode(wire.Submit("bad", [5, 6, 7], wire.SamplingParams(max_tokens=8, **settings))))
    good = submit(engine, dealer, [5, 6, 7, 8])  # turns the engine until the good one is admitted
    rejected = wire.decode_engine_message(dealer.recv())
    assert isinstance(rejected, wire.Rejected) and (rejected.request_id, rejected.status) == ("bad", 400)
    assert next(iter(settings)) in rejected.message
    assert [r.request_id for r in engine.scheduler.slots if r is not None] == [good]


@pytest.mark.parametrize("ends", [[4], [-1], list(range(5))])
def test_message_ends_outside_the_prompt_are_refused(ends: list[int]) -> None:
    engine, _executor, dealer = make_engine()
    dealer.send(wire.encode(wire.Submit("bad", [5, 6, 7], wire.SamplingParams(max_tokens=8), message_ends=ends)))
    submit(engine, dealer, [5, 6, 7, 8])
    rejected = wire.decode_engine_message(dealer.recv())
    assert isinstance(rejected, wire.Rejected) and rejected.status == 400 and "message ends" in rejected.message


def test_an_image_identity_that_cannot_key_the_cache_is_refused() -> None:
    vision = ImageProcessing(image_token_id=9, vision_start_token_id=7, vision_end_token_id=8, min_pixels=1,
                             max_pixels=1 << 20)
    grid = [1, 2, 2]
    patches = bytes(4 * 4 * vision.patch_dim)
    prompt = [1] + [9] * vision.tokens(grid)

    def with_identity(identity: bytes) -> wire.Submit:
        return wire.Submit("r", prompt, wire.SamplingParams(), images=[wire.ImageInput(identity, 1, grid, patches)])

    assert image_problem(with_identity(bytes(32)), vision, "m") is None
    assert "identity" in image_problem(with_identity(bytes(31)), vision, "m")


@pytest.mark.parametrize(("fields", "named"), [
    ({"pooling": "max"}, "pooling"),
    ({"pooling": "mean", "label_queries": [wire.LabelQuery(2, [4])]}, "embedding"),
    ({"pooling": "last", "constraint": wire.Constraint("regex", "a+")}, "embedding")])
def test_an_embedding_that_cannot_be_computed_is_refused(fields: dict, named: str) -> None:
    engine, _executor, dealer = make_engine()
    dealer.send(wire.encode(wire.Submit("bad", [5, 6, 7], wire.SamplingParams(max_tokens=1), **fields)))
    submit(engine, dealer, [5, 6, 7, 8])
    rejected = wire.decode_engine_message(dealer.recv())
    assert isinstance(rejected, wire.Rejected) and rejected.status == 400 and named in rejected.message
