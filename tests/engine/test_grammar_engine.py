"""Structured output inside the engine, without processes: the grammar compiler and its cache, packed masks in
sampling, masks through the eager executor, and the scheduler's split of constrained and free requests."""

from __future__ import annotations

import json
import select

import numpy as np
import pytest
import torch

from engine.sampling.grammar import GrammarCompiler, GrammarError, GrammarSpec, mask_words, plan_masks
from engine.sampling.sampler import SamplingTensors, apply_token_mask, exponential_noise, sample
from frontend.chat.structured import json_schema_text
from tests.engine.test_engine import reference_greedy
from tests.support.engine_harness import Harness, run_split, tiny_model

ZERO_NOISE = (79372, 275)  # (seed, token): exponential_noise at position 0 is exactly 0.0 in float32


@pytest.fixture(scope="module")
def compiler(core_dir):
    manifest = json.loads((core_dir / "manifest.json").read_text())
    compiler = GrammarCompiler((core_dir / "tokenizer.json").read_text(), manifest["config"]["vocab_size"],
                               manifest["eos_token_ids"])
    yield compiler
    compiler.close()


def test_each_request_gets_its_own_matcher(compiler) -> None:
    spec = GrammarSpec("json_schema", json_schema_text({"enum": ["yes", "no"]}, "schema"))
    first, second = compiler.compile(spec), compiler.compile(spec)
    assert first is not second
    assert first.consume_tokens(compiler.tokenizer.tokenize_str('"yes"')) and first.is_accepting()
    assert not second.is_accepting()  # untouched by the first request's tokens


def test_a_spec_that_does_not_compile_fails_its_future_only(compiler) -> None:
    compiler.submit("bad", GrammarSpec("lark", "start: missing"))
    compiler.submit("good", GrammarSpec("regex", "[0-9]+"))
    done: dict[object, object] = {}
    while len(done) < 2:
        select.select([compiler.wake_fd], [], [], 10)
        done.update(compiler.take_done())
    assert isinstance(done["bad"].exception(), GrammarError) and "missing" in str(done["bad"].exception())
    assert done["good"].result().consume_tokens(compiler.tokenizer.tokenize_str("42"))
    with pytest.raises(GrammarError):
        compiler.compile(GrammarSpec("no-such-format", "x"))


@pytest.mark.parametrize("spec,bound", [
    (GrammarSpec("regex", "(a{1000}){1000}"), "over the limit of 10000"),
    (GrammarSpec("lark", "\n".join(["start: r0", *(f'r{i}: "a" r{i + 1}' for i in range(3000)), 'r3000: "b"'])),
     "3002 rules"),
])
def test_a_spec_past_the_bounds_is_refused_before_llguidance_sees_it(compiler, spec: GrammarSpec, bound: str) -> None:
    # The chained rules would overflow llguidance's stack and kill the engine; the repetition costs seconds a mask.
    with pytest.raises(GrammarError, match=bound):
        compiler.compile(spec)


def test_packed_masks_keep_exactly_the_allowed_tokens() -> None:
    rng = np.random.default_rng(0)
    vocab = 100
    allowed = rng.random((3, vocab)) < 0.2
    words = np.zeros((3, mask_words(vocab) * 32), dtype=bool)
    words[:, :vocab] = allowed
    packed = np.packbits(words, axis=1, bitorder="little").view(np.int32)
    masked = apply_token_mask(torch.zeros(3, vocab), torch.from_numpy(packed))
    assert torch.equal(torch.isfinite(masked), torch.from_numpy(allowed))


def params(rows: int, **values: object) -> SamplingTensors:
    def full(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((rows,), value, dtype=dtype)

    return SamplingTensors(**{"temperature": full(1.0), "top_p": full(1.0), "top_k": full(0, torch.int64),
                              "min_p": full(0.0), "seed": full(0, torch.int64), "position": full(0, torch.int64),
                              "presence_penalty": full(0.0), "frequency_penalty": full(0.0),
                              "repetition_penalty": full(1.0), "all_greedy": False, "any_penalty": False, **values})


def test_a_masked_token_is_never_drawn_even_where_its_noise_is_zero() -> None:
    seed, token = ZERO_NOISE
    vocab = 320
    assert exponential_noise(torch.tensor([seed]), torch.tensor([0]), vocab)[0, token] == 0
    only = 7
    packed = np.packbits(np.arange(mask_words(vocab) * 32) == only, bitorder="little").view(np.int32)
    logits = torch.randn(1, vocab)
    drawn = sample(logits, params(1, seed=torch.tensor([seed]), allowed=torch.from_numpy(packed)[None]))
    assert drawn.tolist() == [only]
    top_k = sample(logits, params(1, seed=torch.tensor([seed]), top_k=torch.tensor([1])))  # the same hole
    assert top_k.tolist() == [int(logits.argmax())]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def outputs(request) -> int:
    return len(request.tokens) - request.prompt_len


def test_constrained_requests_wait_for_their_token_while_free_ones_keep_two_steps_in_flight(model) -> None:
    harness = Harness(model)
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    free = harness.add(prompts[0], temperature=0.0, max_tokens=12)
    constrained = harness.add(prompts[1], temperature=1.0, seed=3, max_tokens=12, grammar=object())
    steps = run_split(harness, {constrained}, model.config.vocab_size, allowed=lambda request: 42)
    assert constrained.tokens[len(prompts[1]):] == [42] * 12  # the masks reached sampling
    assert free.tokens[len(prompts[0]):] == reference_greedy(model, prompts[0], 12)  # unchanged by its neighbour
    slot = constrained.slot
    assert not any(slot in rows and slot in busy for rows, busy in steps)  # never the second step in flight
    assert any(free.slot in rows and free.slot in busy for rows, busy in steps)  # free ones do go two deep
    harness.close()


def test_late_masks_let_constrained_requests_go_two_deep_with_masks_after_their_last_token(model) -> None:
    """Each mask allows one token that depends on the outputs committed when it is made (40, 41, 42, ...): a step
    planned before its request's last token came back gets its masks only after that token was committed."""
    harness = Harness(model, late_masks=True)
    prompts = [[5, 6, 7], [9, 10, 11, 12], [20, 21]]
    free = harness.add(prompts[0], temperature=0.0, max_tokens=12)
    constrained = [harness.add(prompts[1], temperature=1.0, seed=3, max_tokens=12, grammar=object()),
                   harness.add(prompts[2], temperature=0.0, max_tokens=9, grammar=object())]
    steps = run_split(harness, set(constrained), model.config.vocab_size, allowed=lambda r: 40 + outputs(r))
    assert constrained[0].tokens[len(prompts[1]):] == list(range(40, 52))
    assert constrained[1].tokens[len(prompts[2]):] == list(range(40, 49))
    assert free.tokens[len(prompts[0]):] == reference_greedy(model, prompts[0], 12)
    assert all(any(r.slot in rows and r.slot in busy for rows, busy in steps) for r in constrained)
    harness.close()


def test_plan_masks_fill_only_constrained_sampled_rows(compiler) -> None:
    from common.protocol import SamplingParams
    from engine.scheduler.plan import Plan, Row

    matcher = compiler.compile(GrammarSpec("choice", '["yes", "no"]'))
    rows = tuple(Row(slot, 1, 0, 1, None, (), True, 0, SamplingParams(), 0, 1) for slot in (0, 1))
    words = mask_words(compiler.vocab_size)
    masks = np.frombuffer(plan_masks(Plan(rows), {1: matcher}, words, compiler.executor), np.int32).reshape(2, -1)
    assert (masks[0] == -1).all()
    allowed = np.flatnonzero(np.unpackbits(masks[1].view(np.uint8), bitorder="little"))
    texts = {compiler.tokenizer.decode_str([int(t)]) for t in allowed}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    assert plan_masks(Plan(rows), {}, words, compiler.executor) == b""


@pytest.mark.parametrize("opened", [True, False])
def test_the_grammar_applies_after_the_reasoning_part(compiler, opened: bool) -> None:
    """A reasoning model's constraint (frontend/chat/structured.py after_reasoning) as the engine compiles it."""
    from frontend.chat.structured import after_reasoning, json_constraint

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    spec = after_reasoning(json_constraint(schema, "schema"), opened)
    replies = {'let me see: {"a": 1} is wrong </think>\n\n{"a": 12}': opened,
               '<think>short</think>{"a": 12}': True, '{"a": 12}': not opened,
               'thinking</think>{"b": 1}': False, '<think>never closed {"a": 12}': False}
    for reply, valid in replies.items():
        matcher = compiler.compile(GrammarSpec(spec.kind, spec.text))
        accepted = matcher.consume_tokens(compiler.tokenizer.tokenize_str(reply)) and matcher.is_accepting()
        assert accepted == valid, reply
