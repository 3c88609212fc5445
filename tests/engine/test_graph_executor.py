"""The graph executor against the eager one.

On the CPU (Triton interpreter): the graph executor's host and device logic without graphs or streams (frames,
page-table patches, static buffers, the captured step functions run eagerly) drives the real scheduler and must
produce the eager executor's tokens. On a GPU: the GraphExecutor itself, captured graphs and all.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

GPU = torch.cuda.is_available()
pytest.importorskip("triton")

from common.protocol import SamplingParams  # noqa: E402
from engine.publication import join_logprobs  # noqa: E402
from engine.executor.eager import kv_cache_shape  # noqa: E402
from engine.executor.frames import (PageTableMirror, host_views, make_layout, pack, verify_results, verify_rows,  # noqa: E402
                                    verify_spans)
from engine.executor.graph import decode_capacities, extend_capacities  # noqa: E402
from engine.executor.graph_step import StaticBuffers, accept_drafts, model_step, sample_step  # noqa: E402
from engine.executor.pooling import assemble as assemble_pooled  # noqa: E402
from engine.executor.pooling import pool_index, pool_rows  # noqa: E402
from engine.kernels.triton import dependent_launch  # noqa: E402
from engine.model.backends import few_rows, triton_layers  # noqa: E402
from engine.model.backends.select import use_backend  # noqa: E402
from engine.model.recurrent_state import SNAPSHOTS_PER_SLOT, RecurrentState  # noqa: E402
from engine.sampling.graph_extras import (TOP_LOGPROBS, ExtrasBuffers, extras_words, graph_holds_extras,  # noqa: E402
                                          host_extras_views, pack_extras, prompt_logprobs_step, read_logprobs,
                                          read_prompt_logprobs, step_extras)
from engine.sampling.label_scores import assemble, graph_index  # noqa: E402
from engine.sampling.penalty_state import apply_known_tokens  # noqa: E402
from engine.scheduler.plan import Completion, Plan, Row  # noqa: E402
from tests.support.engine_harness import Harness, run_split, tiny_model  # noqa: E402

PROMPTS = [[5, 6, 7], list(range(10, 60)), list(range(100, 131)), [42], list(range(200, 223))]
MAX_ACTIVE, PAGES, PAGE_SIZE, CHUNK, CONTEXT = 8, 64, 16, 48, 1024


def row(slot: int, generation: int, table: tuple[int, ...]) -> Row:
    return Row(slot, generation, 0, 1, None, table, True, 0, SamplingParams(), 0, 1)


def test_page_table_mirror_sends_only_what_changed() -> None:
    mirror = PageTableMirror(slots=4, width=8)
    assert mirror.changes((row(1, 1, (5, 6)),)) == ([8, 9], [5, 6])
    assert mirror.changes((row(1, 1, (5, 6)),)) == ([], [])
    assert mirror.changes((row(1, 1, (5, 6, 9)),)) == ([10], [9])
    assert mirror.changes((row(1, 2, (5, 6, 9)),)) == ([8, 9, 10], [5, 6, 9])  # a new request in the slot
    assert mirror.changes((row(1, 2, (5, 6, 7)),)) == ([8, 9, 10], [5, 6, 7])  # a page replaced in place
    mirror.forget([1])
    assert mirror.changes((row(1, 2, (5, 6, 7)),)) == ([8, 9, 10], [5, 6, 7])
    with pytest.raises(ValueError):
        mirror.changes((row(2, 1, tuple(range(9))),))


def test_capacities_cover_every_plan() -> None:
    assert decode_capacities(64) == [1, 2, 4, 8, 16, 32, 64]
    assert decode_capacities(48) == [1, 2, 4, 8, 16, 32, 48]
    assert extend_capacities(512, 64) == [64, 128, 192, 256, 320, 384, 448, 512, 576]
    assert extend_capacities(2048, 256)[-1] >= 2048 + 256
    assert extend_capacities(8192, 256) == [64, 128, 192, 256, 320, 384, 448, 512, 768, 1024, 1280, 1536, 1792,
                                            2048, 3072, 4096, 5120, 6144, 7168, 8192, 8448]


class FrameExecutor:
    """GraphExecutor's data path on the CPU: pack a frame, copy it to the static buffers, run the step functions
    a graph would replay, read the sampled rows. Synchronous; the executor protocol for the harness."""

    def __init__(self, model, num_pages: int, page_size: int, max_active: int, snapshots: int = 0) -> None:
        self.kv_cache = torch.zeros(kv_cache_shape(model, num_pages, page_size), dtype=model.cache_dtype)
        self.model, self.page_size, self.trash, self.num_pages = model, page_size, max_active, num_pages
        # A hybrid's state rows (the slots', then the snapshots'), and its row copies in the frames, as GraphExecutor
        self.state = RecurrentState(model.config, max_active + snapshots, torch.float32, torch.device("cpu")) \
            if model.config.hybrid else None
        copies = 2 * max_active if self.state is not None else 0
        self.decode = {b: make_layout("decode", b, b, copies) for b in decode_capacities(max_active)}
        self.extend = {t: make_layout("extend", t, min(t, max_active), copies)
                       for t in extend_capacities(CHUNK, max_active)}
        width = CONTEXT // page_size
        layouts = [*self.decode.values(), *self.extend.values()]
        words = max(layout.patches for layout in layouts) + 2 * max_active * width
        self.buffers = StaticBuffers.allocate(words, max_active, width, max(lay.seqs for lay in layouts),
                                              model.config.vocab_size, torch.device("cpu"))
        self.frame = np.zeros(words, dtype=np.int32)
        self.mirror = PageTableMirror(max_active, width)
        max_seqs = max(lay.seqs for lay in layouts)
        # Prompt logprobs in launches of 16 positions: a 48-token chunk takes three, as long prompts do on a GPU.
        self.extras = ExtrasBuffers.allocate(max_active, max_seqs, max(self.extend), model.config.vocab_size,
                                             model.config.hidden_size, torch.float32, torch.device("cpu"), 16)
        self.extras_frame = np.zeros(extras_words(max_seqs), dtype=np.int32)
        self.extras_steps = 0
        self.fence, self.done, self.layouts_used = 0, [], set()
        self.frame_state_copies = 0  # a hybrid's row copies the frames carried
        self.wake_fd, self._write = os.pipe()

    def can_submit(self) -> bool:
        return True

    def next_fence(self) -> int:
        return self.fence + 1

    def submit(self, plan: Plan) -> None:
        self.fence += 1
        verify = any(r.draft for r in plan.rows)  # as GraphExecutor: one-token rows in a decode graph
        for source, destination in plan.copies:  # as GraphExecutor._copy_pages
            pages = slice(source * self.page_size, (source + 1) * self.page_size)
            self.kv_cache[:, :, destination * self.page_size:(destination + 1) * self.page_size] = \
                self.kv_cache[:, :, pages]
        if not plan.rows:  # only copies: GraphExecutor's eager step makes them
            self.state.copy_rows(plan.state_copies)
            self.done.append((plan, Completion(self.fence, (), (), (), 0.0)))
            os.write(self._write, b"x")
            return
        rows = verify_rows(plan.rows) if verify else plan.rows
        if all(r.tokens is None for r in plan.rows) or verify:
            layout = self.decode[min(b for b in self.decode if b >= len(rows))]
        else:
            layout = self.extend[min(t for t in self.extend if t >= plan.num_tokens)]
        self.layouts_used.add(("verify" if verify else layout.kind, layout.tokens))
        self.frame[:] = 12345  # stale words from earlier steps must not matter
        self.frame_state_copies += len(plan.state_copies)
        words = pack(Plan(rows, state_copies=plan.state_copies), layout, self.frame, host_views(self.frame, layout), self.mirror, self.page_size,
                     self.trash)
        self.buffers.frame[:words] = torch.from_numpy(self.frame[:words])
        extras = None if verify else step_extras(plan.rows, self.model.config.vocab_size)
        assert graph_holds_extras(plan.rows), "GraphExecutor runs this step eagerly"
        if extras is not None:  # as GraphExecutor._upload_extras
            self.extras_steps += 1
            apply_known_tokens(self.extras.counts, self.extras.seen, *map(torch.from_numpy, extras.known))
            if extras.sample:
                pack_extras(plan.rows, host_extras_views(self.extras_frame, layout.seqs))
                self.extras.inputs[:] = torch.from_numpy(self.extras_frame)
                self.buffers.masks[:layout.seqs] = -1
        model_step(self.model, self.kv_cache, self.buffers, layout, self.page_size,
                   self.extras.hidden if layout.kind == "extend" else None, self.state)
        prompt = self.prompt_logprobs(extras.prompt) if extras is not None and extras.prompt.shape[1] else None
        greedy = all(r.sampling.temperature == 0 for r in plan.rows if r.sample)
        if plan.masks:  # as GraphExecutor uploads them: one row per plan row
            masks = torch.from_numpy(np.frombuffer(plan.masks, np.int32).reshape(len(plan.rows), -1).copy())
            self.buffers.masks[:len(plan.rows)] = masks
        sample_step(self.buffers, layout, greedy, masked=bool(plan.masks),
                    extras=self.extras if extras is not None and extras.sample else None)
        samples = self.buffers.sampled[:len(rows)].tolist()
        accepted = []
        if verify:
            spans, width = verify_spans(plan.rows)
            verdicts = accept_drafts(self.buffers, layout, torch.from_numpy(spans), width).numpy()
            tokens, accepted = verify_results(plan.rows, samples, verdicts)
        else:
            tokens = [t for r, t in zip(plan.rows, samples) if r.sample]
        sampled = [r for r in plan.rows if r.sample]
        found, index = graph_index(plan, self.model.config.vocab_size)  # GraphExecutor's label gather
        pooling, pooled_index = pool_index(plan)  # GraphExecutor's pooling, from the extend graph's hidden states
        pooled = torch.empty(len(pooling), self.model.config.hidden_size)
        pool_rows(self.extras.hidden, torch.from_numpy(pooled_index), pooled)
        scores = assemble(found, self.buffers.logits.view(-1)[torch.tensor(index, dtype=torch.int64)].tolist())
        top = self.extras.top
        logprobs = read_logprobs(plan.rows, tokens, self.extras.logprobs.numpy(), top) \
            if extras is not None and extras.logprobs else ()
        self.done.append((plan, Completion(self.fence, tuple(r.slot for r in sampled),
                                           tuple(r.generation for r in sampled), tuple(tokens), 0.0,
                                           scores=scores, accepted=tuple(accepted), logprobs=logprobs,
                                           pooled=assemble_pooled(pooling, pooled.numpy()),
                                           prompt_logprobs=() if prompt is None else
                                           read_prompt_logprobs(plan.rows, prompt, top))))
        os.write(self._write, b"x")

    def prompt_logprobs(self, positions: np.ndarray) -> np.ndarray:
        """As GraphExecutor._prompt_logprobs: the prompt graph's step once per `prompt_rows` positions."""
        out, size = [], self.extras.prompt_rows
        for first in range(0, positions.shape[1], size):
            chunk = positions[:, first:first + size]
            self.extras.prompt_positions.zero_()
            self.extras.prompt_positions[:, :chunk.shape[1]] = torch.from_numpy(chunk)
            prompt_logprobs_step(self.model, self.extras)
            out.append(self.extras.prompt_logprobs[:chunk.shape[1]].clone())
        return torch.cat(out).numpy()

    def poll(self) -> list:
        os.read(self.wake_fd, 1 << 16)
        done, self.done = self.done, []
        return done

    def close(self) -> None:
        os.close(self.wake_fd)
        os.close(self._write)


def run_requests(harness: Harness) -> list[list[int]]:
    requests = [harness.add(p, temperature=0.0, max_tokens=6) for p in PROMPTS[:-1]]
    requests.append(harness.add(PROMPTS[-1], temperature=0.9, top_p=0.9, top_k=50, seed=11, max_tokens=6))
    harness.run()
    harness.close()
    return [r.tokens[r.prompt_len:] for r in requests]


@pytest.mark.skipif(GPU, reason="the GPU runs the GraphExecutor itself (below)")
def test_frame_steps_produce_the_eager_executors_tokens() -> None:
    eager = Harness(tiny_model(), PAGES, PAGE_SIZE, MAX_ACTIVE, CHUNK)
    expected = run_requests(eager)
    model = tiny_model()
    use_backend(model, "triton", CONTEXT)
    harness = Harness(model, PAGES, PAGE_SIZE, MAX_ACTIVE, CHUNK)
    harness.executor.close()
    harness.executor = executor = FrameExecutor(model, PAGES, PAGE_SIZE, MAX_ACTIVE)
    assert run_requests(harness) == expected
    assert {kind for kind, _ in executor.layouts_used} == {"decode", "extend"}


def fp8_kernel_model(family: str = "llama"):  # noqa: ANN201
    """A tiny model on the kernel path over an FP8 KV cache (engine/model/kv_quant.py), its per-head scales other
    than 1."""
    from engine.model.attention import PagedAttention
    from engine.model.kv_quant import FP8

    model = tiny_model(family=family)
    model.kv_dtype = FP8
    generator = torch.Generator().manual_seed(3)
    for module in model.modules():
        if isinstance(module, PagedAttention):
            module.kv_scale = torch.rand(module.kv_scale.shape, generator=generator) + 0.5
    return model


@pytest.mark.skipif(GPU, reason="the GPU runs the GraphExecutor itself (below)")
def test_frame_steps_over_an_fp8_cache_produce_the_eager_kernel_paths_tokens() -> None:
    model = fp8_kernel_model()
    use_backend(model, "triton", CONTEXT)
    eager = Harness(model, PAGES, PAGE_SIZE, MAX_ACTIVE, CHUNK)
    assert eager.executor.kv_cache.dtype == model.cache_dtype
    expected = run_few_requests(eager)
    harness = Harness(model, PAGES, PAGE_SIZE, MAX_ACTIVE, CHUNK)
    harness.executor.close()
    harness.executor = FrameExecutor(model, PAGES, PAGE_SIZE, MAX_ACTIVE)
    assert run_few_requests(harness) == expected


@pytest.mark.skipif(GPU, reason="the GPU runs the GraphExecutor itself (tests/engine/test_speculative.py)")
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, top_k=50, seed=11)])
def test_frame_verify_steps_keep_plain_decodings_tokens(sampling: dict) -> None:
    """Verify rounds as the GraphExecutor runs them (one-token rows in a decode frame, drafts accepted after
    sampling) give plain decoding's tokens, with drafts that are partly wrong."""
    from tests.engine.test_speculative import ReplayProposer

    def run(proposer: object) -> tuple[list[list[int]], set]:
        model = tiny_model()
        use_backend(model, "triton", CONTEXT)
        harness = Harness(model, PAGES, PAGE_SIZE, MAX_ACTIVE, CHUNK, proposer=proposer)
        harness.executor.close()
        # Decode frames up to 32 rows: two requests verifying up to 8 positions each
        harness.executor = executor = FrameExecutor(model, PAGES, PAGE_SIZE, 32)
        requests = [harness.add(p, max_tokens=10, **sampling) for p in prompts]
        harness.run()
        harness.close()
        return [r.tokens[r.prompt_len:] for r in requests], executor.layouts_used

    prompts = [PROMPTS[0], PROMPTS[2]]
    plain, _ = run(None)
    speculative, layouts = run(ReplayProposer({tuple(p): o for p, o in zip(prompts, plain)}, 0.3))
    assert speculative == plain
    assert any(kind == "verify" for kind, _ in layouts)


def masked_run(harness: Harness, vocab: int) -> tuple[list[int], list[int]]:
    """A free greedy request beside a sampled one whose masks allow a single token, 40 plus its outputs so far
    (tests/engine/test_grammar_engine.py)."""
    free = harness.add(PROMPTS[0], temperature=0.0, max_tokens=10)
    constrained = harness.add(PROMPTS[1], temperature=1.0, seed=3, max_tokens=10, grammar=object())
    run_split(harness, {constrained}, vocab, allowed=lambda request: 40 + len(request.tokens) - request.prompt_len)
    harness.close()
    return free.tokens, constrained.tokens


@pytest.mark.skipif(GPU, reason="the GPU runs the GraphExecutor itself (below)")
def test_frame_steps_apply_grammar_masks_as_the_eager_executor_does() -> None:
    model = tiny_model()
    expected = masked_run(Harness(model, PAGES, PAGE_SIZE, MAX_ACTIVE, CHUNK), model.config.vocab_size)
    assert expected[1][-10:] == list(range(40, 50))
    use_backend(model, "triton", CONTEXT)
    harness = Harness(model, PAGES, PAGE_SIZE, MAX_ACTIVE, CHUNK)
    harness.executor.close()
    harness.executor = FrameExecutor(model, PAGES, PAGE_SIZE, MAX_ACTIVE)
    assert masked_run(harness, model.config.vocab_size) == expected


def run_extras(harness: Harness, stop: int) -> list[tuple]:
    """Plain rows beside rows that ask for penalties, logprobs (the top 20), prompt logprobs (a prompt over several
    chunks among them) and a min_tokens ban of `stop`; per request its tokens, per-token and prompt logprobs."""
    requests = [harness.add(PROMPTS[0], temperature=0.0, max_tokens=8),
                harness.add(PROMPTS[1], temperature=0.0, repetition_penalty=1.5, presence_penalty=0.5,
                            frequency_penalty=0.7, max_tokens=8),
                harness.add(PROMPTS[2], temperature=0.9, top_k=50, seed=5, frequency_penalty=1.0,
                            logprobs=TOP_LOGPROBS, max_tokens=8),
                harness.add(PROMPTS[3], temperature=0.0, logprobs=3, max_tokens=8),
                harness.add(PROMPTS[4], temperature=0.0, logprobs=0, prompt_logprobs=TOP_LOGPROBS, max_tokens=4),
                harness.add(list(range(150, 250)), temperature=0.0, prompt_logprobs=0, max_tokens=3),
                harness.add(PROMPTS[0], temperature=0.0, min_tokens=5, stop_token_ids=[stop], max_tokens=8)]
    logprobs: dict = {request: [] for request in requests}
    while harness.scheduler.has_work():
        for result in harness.step():
            for request, _, lp in result.tokens:
                logprobs[request].append(lp)
    harness.run()
    harness.close()
    # Prompt logprobs come in pieces, a piece per chunk, as the scheduler chunked the prompt: joined as published.
    return [(r.tokens[r.prompt_len:], logprobs[r], [join_logprobs(r.prompt_logprobs)] if r.prompt_logprobs else [])
            for r in requests]


def assert_same_logprobs(got: list, want: list, tolerance: float) -> None:
    assert len(got) == len(want)
    for mine, theirs in zip(got, want):
        assert (mine is None) == (theirs is None)
        if mine is None:
            continue
        assert mine.token_ids == theirs.token_ids and mine.top_ids == theirs.top_ids
        torch.testing.assert_close(torch.tensor(mine.logprobs), torch.tensor(theirs.logprobs), atol=tolerance,
                                   rtol=tolerance)
        torch.testing.assert_close(torch.tensor(mine.top_logprobs), torch.tensor(theirs.top_logprobs),
                                   atol=tolerance, rtol=tolerance)


def assert_same_extras(got: list[tuple], want: list[tuple], tolerance: float) -> None:
    for (tokens, logprobs, prompt), (want_tokens, want_logprobs, want_prompt) in zip(got, want, strict=True):
        assert tokens == want_tokens
        assert_same_logprobs(logprobs, want_logprobs, tolerance)
        assert_same_logprobs(prompt, want_prompt, tolerance)


def first_greedy_token(harness: Harness) -> int:
    request = harness.add(PROMPTS[0], temperature=0.0, max_tokens=1)
    harness.run()
    harness.close()
    return request.tokens[-1]


@pytest.mark.skipif(GPU, reason="the GPU runs the GraphExecutor itself (below)")
def test_frame_steps_apply_penalties_bans_and_logprobs_as_the_eager_executor_does() -> None:
    """Every step of the mix runs in frames (no eager step exists here), with the eager executor's tokens, and its
    logprobs within 1e-4 (fp32: the Triton kernels against the torch path)."""
    stop = first_greedy_token(Harness(tiny_model(), PAGES, PAGE_SIZE, MAX_ACTIVE, CHUNK))
    expected = run_extras(Harness(tiny_model(), PAGES, PAGE_SIZE, MAX_ACTIVE, CHUNK), stop)
    assert expected[0][0][0] == stop and stop not in expected[-1][0][:5], "min_tokens bans the stop id"
    assert len(expected[2][1][0].top_ids[0]) == TOP_LOGPROBS and len(expected[5][2][0].token_ids) == 99
    model = tiny_model()
    use_backend(model, "triton", CONTEXT)
    harness = Harness(model, PAGES, PAGE_SIZE, MAX_ACTIVE, CHUNK)
    harness.executor.close()
    harness.executor = executor = FrameExecutor(model, PAGES, PAGE_SIZE, MAX_ACTIVE)
    assert_same_extras(run_extras(harness, stop), expected, 1e-4)
    assert executor.extras_steps > 0


def test_graphs_hold_the_openai_maximum_of_logprobs_and_send_more_to_the_eager_step() -> None:
    def asking(**sampling: object) -> tuple[Row, ...]:
        return (row(0, 1, (1,)), row(1, 1, (2,))._replace(sampling=SamplingParams(**sampling)))

    assert graph_holds_extras(asking(logprobs=TOP_LOGPROBS, prompt_logprobs=TOP_LOGPROBS))
    assert not graph_holds_extras(asking(logprobs=TOP_LOGPROBS + 1))
    assert not graph_holds_extras(asking(prompt_logprobs=TOP_LOGPROBS + 1))
    assert graph_holds_extras((row(0, 1, (1,))._replace(banned=tuple(range(16))),))
    assert not graph_holds_extras((row(0, 1, (1,))._replace(banned=tuple(range(17))),))


# What each family's kernel path adds: q/k/v bias, q/k norm, the fused MoE (Mixtral's differs by configuration
# only), Gemma 3's norms, scale and GeLU, with its sliding-window layers and without.
FAMILY_CASES = [("qwen2", {}), ("qwen3", {}), ("qwen3_moe", {}), ("gemma3_text", {}),
                ("gemma3_text", {"layer_types": ["full_attention"] * 3})]


def run_few_requests(harness: Harness) -> list[list[int]]:
    """A prompt over a chunk and the window, a short one, a sampled one: the interpreter is slow."""
    requests = [harness.add(PROMPTS[1], temperature=0.0, max_tokens=4), harness.add(PROMPTS[3], temperature=0.0,
                                                                                    max_tokens=4),
                harness.add(PROMPTS[4], temperature=0.9, top_p=0.9, top_k=50, seed=11, max_tokens=4)]
    harness.run()
    harness.close()
    return [r.tokens[r.prompt_len:] for r in requests]


@pytest.mark.skipif(GPU, reason="the GPU runs the GraphExecutor itself (below)")
@pytest.mark.parametrize("family, changes", FAMILY_CASES)
def test_each_familys_kernel_path_produces_the_torch_paths_tokens(family: str, changes: dict) -> None:
    expected = run_few_requests(Harness(tiny_model(0, family, **changes), PAGES, PAGE_SIZE, MAX_ACTIVE, CHUNK))
    model = tiny_model(0, family, **changes)
    use_backend(model, "triton", CONTEXT)
    harness = Harness(model, PAGES, PAGE_SIZE, MAX_ACTIVE, CHUNK)
    harness.executor.close()
    harness.executor = FrameExecutor(model, PAGES, PAGE_SIZE, MAX_ACTIVE)
    assert run_few_requests(harness) == expected


LABELS = (3, 17, 250)


def run_scored(harness: Harness) -> tuple[list[list[int]], list[dict]]:
    """Scored prefills read at their last position (as the generic decision prompt does), beside generation;
    a long one is computed in several chunks. Their label logits, and the generated tokens."""
    generating = [harness.add(p, temperature=0.0, max_tokens=6) for p in PROMPTS[:2]]
    scored = [harness.add(p, label_queries=[(len(p) - 1, LABELS)]) for p in (PROMPTS[2], list(range(150)), [9, 4])]
    harness.run()
    harness.close()
    assert all(r.finish_reason == "stop" and r.outputs == 0 for r in scored)
    return [r.tokens[r.prompt_len:] for r in generating], [r.label_logits for r in scored]


def assert_same_scores(got: list[dict], want: list[dict], tolerance: float) -> None:
    for mine, theirs in zip(got, want):
        assert mine.keys() == theirs.keys()
        for position in theirs:
            torch.testing.assert_close(torch.tensor(mine[position]), torch.tensor(theirs[position]),
                                       atol=tolerance, rtol=tolerance)


@pytest.mark.skipif(GPU, reason="the GPU runs the GraphExecutor itself (below)")
def test_frame_steps_read_the_eager_executors_label_logits() -> None:
    eager_tokens, eager_scores = run_scored(Harness(tiny_model(), PAGES, PAGE_SIZE, MAX_ACTIVE, CHUNK))
    model = tiny_model()
    use_backend(model, "triton", CONTEXT)
    harness = Harness(model, PAGES, PAGE_SIZE, MAX_ACTIVE, CHUNK)
    harness.executor.close()
    harness.executor = FrameExecutor(model, PAGES, PAGE_SIZE, MAX_ACTIVE)
    tokens, scores = run_scored(harness)
    assert tokens == eager_tokens
    assert_same_scores(scores, eager_scores, 1e-4)


def run_pooled(harness: Harness) -> tuple[list[list[int]], list[np.ndarray]]:
    """Embeddings, last-token and mean, beside generation; the long ones are computed in several chunks. Their
    vectors, and the generated tokens."""
    generating = [harness.add(PROMPTS[1], temperature=0.0, max_tokens=2)]
    embeddings = [harness.add(p, pooling=pooling)
                  for p, pooling in ((PROMPTS[2], "last"), (list(range(60)), "mean"), ([9], "mean"))]
    harness.run()
    harness.close()
    assert all(r.finish_reason == "stop" and r.outputs == 0 for r in embeddings)
    return [r.tokens[r.prompt_len:] for r in generating], [r.embedding() for r in embeddings]


def assert_same_vectors(got: list[np.ndarray], want: list[np.ndarray], tolerance: float) -> None:
    assert len(got) == len(want)
    for mine, theirs in zip(got, want):
        torch.testing.assert_close(torch.from_numpy(mine), torch.from_numpy(theirs), atol=tolerance, rtol=tolerance)


@pytest.mark.skipif(GPU, reason="the GPU runs the GraphExecutor itself (below)")
def test_frame_steps_pool_the_eager_executors_embeddings() -> None:
    eager_tokens, eager_vectors = run_pooled(Harness(tiny_model(), PAGES, PAGE_SIZE, MAX_ACTIVE, CHUNK))
    model = tiny_model()
    use_backend(model, "triton", CONTEXT)
    harness = Harness(model, PAGES, PAGE_SIZE, MAX_ACTIVE, CHUNK)
    harness.executor.close()
    harness.executor = FrameExecutor(model, PAGES, PAGE_SIZE, MAX_ACTIVE)
    tokens, vectors = run_pooled(harness)
    assert tokens == eager_tokens
    assert_same_vectors(vectors, eager_vectors, 1e-4)


def gpu_harness(model, graphs: bool, snapshots: int | None = None, late_masks: bool = False) -> Harness:
    """`snapshots`: a hybrid's snapshot rows (None: the engine's default); `late_masks`: the Harness's."""
    from engine.executor.eager import EagerExecutor
    from engine.executor.graph import GraphExecutor

    harness = Harness(model, PAGES, PAGE_SIZE, MAX_ACTIVE, CHUNK, snapshots=snapshots, late_masks=late_masks)
    harness.executor.close()
    cuda = torch.device("cuda")
    rows = (SNAPSHOTS_PER_SLOT * MAX_ACTIVE if snapshots is None else snapshots) if model.config.hybrid else 0
    harness.executor = GraphExecutor(model, PAGES, PAGE_SIZE, MAX_ACTIVE, cuda, CONTEXT, CHUNK, rows) if graphs \
        else EagerExecutor(model, PAGES, PAGE_SIZE, MAX_ACTIVE, cuda, rows)
    return harness


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_executor_produces_the_eager_executors_tokens(dtype: torch.dtype) -> None:
    model = tiny_model().to("cuda", dtype)
    use_backend(model, "triton", CONTEXT)
    assert run_requests(gpu_harness(model, graphs=True)) == run_requests(gpu_harness(model, graphs=False))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU or torch.cuda.get_device_capability()[0] < 9,
                    reason="dependent launches need a GPU of compute capability 9 or later")
@pytest.mark.parametrize("launch", [dependent_launch.WAIT_FIRST, dependent_launch.PREFETCH,
                                    dependent_launch.PREFETCH_EARLY])
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_one_row_graphs_of_dependent_launches_produce_the_plain_launches_tokens(
        family: str, launch: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request alone decodes in the one-row graphs (engine/model/backends/few_rows.py), each kernel of its chain
    launched as a dependent launch: a kernel that read before the one before it had written would change them."""
    def alone(harness: Harness) -> list[int]:
        request = harness.add(PROMPTS[0], temperature=0.0, max_tokens=12)
        harness.run()
        harness.close()
        return request.tokens[request.prompt_len:]

    model = tiny_model(0, family).to("cuda", torch.bfloat16)
    use_backend(model, "triton", CONTEXT)
    plain = alone(gpu_harness(model, graphs=True))
    monkeypatch.setattr(few_rows, "LAUNCH", launch)
    assert alone(gpu_harness(model, graphs=True)) == plain


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_decode_attention_with_its_rotary_gives_the_separate_launches_tokens(
        family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 steps, graphs and eager, with the rotary and cache store inside the decode kernel, against them in a
    kernel of their own."""
    model = tiny_model(0, family).to("cuda", torch.float32)
    use_backend(model, "triton", CONTEXT)
    monkeypatch.setattr(triton_layers, "ROTARY_IN_DECODE", False)
    separate = run_requests(gpu_harness(model, graphs=True))
    monkeypatch.setattr(triton_layers, "ROTARY_IN_DECODE", True)
    assert run_requests(gpu_harness(model, graphs=True)) == separate
    assert run_requests(gpu_harness(model, graphs=False)) == separate


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_graph_executor_produces_the_eager_executors_tokens_over_an_fp8_cache(family: str) -> None:
    """--kv-cache-dtype fp8 in bfloat16 (a hybrid's full-attention layers only)."""
    from engine.model.kv_quant import FP8

    model = fp8_kernel_model(family).to("cuda", torch.bfloat16)
    use_backend(model, "triton", CONTEXT)
    graphs = gpu_harness(model, graphs=True)
    assert graphs.executor.kv_cache.dtype == FP8
    assert run_requests(graphs) == run_requests(gpu_harness(model, graphs=False))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_executor_pools_the_eager_executors_embeddings(dtype: torch.dtype) -> None:
    model = tiny_model().to("cuda", dtype)
    use_backend(model, "triton", CONTEXT)
    tokens, vectors = run_pooled(gpu_harness(model, graphs=True))
    eager_tokens, eager_vectors = run_pooled(gpu_harness(model, graphs=False))
    assert tokens == eager_tokens
    assert_same_vectors(vectors, eager_vectors, 1e-4 if dtype == torch.float32 else 2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("family, changes", FAMILY_CASES)
def test_graph_executor_produces_the_eager_executors_tokens_for_each_family(family: str, changes: dict) -> None:
    model = tiny_model(0, family, **changes).to("cuda", torch.bfloat16)
    use_backend(model, "triton", CONTEXT)
    assert run_requests(gpu_harness(model, graphs=True)) == run_requests(gpu_harness(model, graphs=False))


# Qwen3-30B-A3B's routing (128 experts, top 8) at a server's step budget: 8,192 prompt tokens are 65,536 token-expert
# pairs, the grouped path's device sort, and the step pads to its graph's capacity.
BUDGET_MOE = {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 32, "mlp_only_layers": [],
              "hidden_size": 128, "vocab_size": 1024}
BUDGET = 8192


def run_budget_steps(model, graphs: bool) -> tuple[list[list[int]], int]:
    """Sixteen prompts that fill one prompt step of the budget (and then decode): their greedy tokens, and the
    largest step's token count. Prompt ids stay below 600 while the vocabulary is 1,024, as published checkpoints
    pad their vocabularies past the tokenizer's."""
    from engine.executor.eager import EagerExecutor
    from engine.executor.graph import GraphExecutor

    harness = Harness(model, 1024, PAGE_SIZE, 16, BUDGET)
    harness.executor.close()
    cuda = torch.device("cuda")
    harness.executor = GraphExecutor(model, 1024, PAGE_SIZE, 16, cuda, CONTEXT, BUDGET) if graphs else \
        EagerExecutor(model, 1024, PAGE_SIZE, 16, cuda)
    sizes, submit = [], harness.executor.submit
    harness.executor.submit = lambda plan: (sizes.append(sum(row.length for row in plan.rows)), submit(plan))[1]
    g = torch.Generator().manual_seed(3)
    requests = [harness.add(torch.randint(0, 600, (500 + 3 * i,), generator=g).tolist(), temperature=0.0,
                            max_tokens=4) for i in range(16)]
    harness.run()
    harness.close()
    return [r.tokens[r.prompt_len:] for r in requests], max(sizes)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_moe_steps_of_a_whole_step_budget_match_the_torch_reference() -> None:
    """The sizes at which a served Qwen3-30B-A3B once failed with a device-side assert: graph and eager kernel
    steps give the torch reference's tokens (fp32)."""
    reference = tiny_model(0, "qwen3_moe", **BUDGET_MOE).to("cuda")
    expected, largest = run_budget_steps(reference, graphs=False)
    assert largest > BUDGET - 256  # one step holds nearly the whole budget (8,168 prompt tokens, padded in a graph)
    for graphs in (False, True):
        model = tiny_model(0, "qwen3_moe", **BUDGET_MOE).to("cuda")
        use_backend(model, "triton", CONTEXT)
        assert run_budget_steps(model, graphs)[0] == expected


def count_eager_steps(harness: Harness, refuse: bool = False) -> list:
    """The plans the GraphExecutor runs through the eager step (with `refuse`, such a step fails instead)."""
    eager_steps, run_eager = [], harness.executor._run_eager

    def counted(fence: int, plan: Plan) -> Completion:
        eager_steps.append(plan)
        if refuse:
            raise AssertionError("an eager step in a mix the graphs hold")
        return run_eager(fence, plan)
    harness.executor._run_eager = counted
    return eager_steps


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_graph_executor_runs_penalties_bans_and_logprobs_in_graphs() -> None:
    """The mix of the frame test above, every step in graphs (an eager step fails the test), with the eager
    executor's tokens and its logprobs within 1e-4 (fp32)."""
    model = tiny_model().to("cuda")
    use_backend(model, "triton", CONTEXT)
    stop = first_greedy_token(gpu_harness(model, graphs=False))
    expected = run_extras(gpu_harness(model, graphs=False), stop)
    harness = gpu_harness(model, graphs=True)
    count_eager_steps(harness, refuse=True)
    assert_same_extras(run_extras(harness, stop), expected, 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_graph_executor_sends_more_logprobs_than_its_graphs_hold_to_the_eager_step() -> None:
    model = tiny_model().to("cuda")
    use_backend(model, "triton", CONTEXT)
    results = []
    for graphs in (True, False):
        harness = gpu_harness(model, graphs)
        eager_steps = count_eager_steps(harness) if graphs else []
        wide = harness.add(PROMPTS[2], temperature=0.0, max_tokens=3, logprobs=TOP_LOGPROBS + 5)
        logprobs = []
        while harness.scheduler.has_work():
            logprobs += [lp for result in harness.step() for _, _, lp in result.tokens]
        harness.run()
        harness.close()
        assert [len(lp.top_ids[0]) for lp in logprobs] == [TOP_LOGPROBS + 5] * 3
        assert bool(eager_steps) == graphs
        results.append((wide.tokens, logprobs))
    assert results[0][0] == results[1][0]
    assert_same_logprobs(results[0][1], results[1][1], 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_scored_prefills_run_in_the_extend_graphs_and_read_the_eager_label_logits() -> None:
    model = tiny_model().to("cuda")
    use_backend(model, "triton", CONTEXT)
    harness = gpu_harness(model, graphs=True)
    eager_steps = count_eager_steps(harness)
    tokens, scores = run_scored(harness)
    assert eager_steps == [], "every step of these scored prefills has a graph"
    eager_tokens, eager_scores = run_scored(gpu_harness(model, graphs=False))
    assert tokens == eager_tokens
    assert_same_scores(scores, eager_scores, 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("late", [False, True], ids=["with-the-step", "late"])
def test_graph_executor_applies_grammar_masks_as_the_eager_executor_does(late: bool) -> None:
    """Masks with the step, and masks given after submit (Plan.masks_later: the model graph runs before them)."""
    model = tiny_model().to("cuda")
    use_backend(model, "triton", CONTEXT)
    graph = masked_run(gpu_harness(model, graphs=True, late_masks=late), model.config.vocab_size)
    assert graph == masked_run(gpu_harness(model, graphs=False, late_masks=late), model.config.vocab_size)
    assert graph[1][-10:] == list(range(40, 50))


# The hybrids (Gated DeltaNet layers beside gated attention: engine/model/backends/triton_linear.py).
HYBRIDS = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
FIRST_TURN, TURN_ENDS = 24, [9, 14]  # the first prompt's length and message ends (neither on a page boundary)


def two_turns(harness: Harness) -> tuple[int, list[list[int]]]:
    """A first turn, another request (which takes the slot and its state row over), then a second turn that
    continues the first (prompt, reply, one more token, so that the restored conv inputs reach its output: the tiny
    model's decay forgets older tokens fast): the second's cached tokens, and both replies. With snapshots, the
    second restores the first's exact checkpoint (the snapshot row copied into the slot's)."""
    from tests.engine.test_hybrid_checkpoints import generate, prompt

    first = prompt(FIRST_TURN)
    _, reply = generate(harness, first, 3, TURN_ENDS)
    generate(harness, prompt(12, seed=2), 2)
    cached, second = generate(harness, first + reply + first[-1:], 3)
    harness.close()
    return cached, [reply, second]


@pytest.mark.skipif(GPU, reason="the GPU runs the GraphExecutor itself (below)")
def test_hybrid_frame_steps_restore_snapshots_and_produce_the_torch_paths_tokens() -> None:
    """Qwen3.5 through the frames and the captured step functions (the kernel path, the state rows by slot, the
    row copies in the frame): a second turn restored from a snapshot equals the torch reference's cold run."""
    cold = two_turns(Harness(tiny_model(0, "qwen3_5"), PAGES, PAGE_SIZE, MAX_ACTIVE, CHUNK, snapshots=0))
    assert cold[0] == 0
    model = tiny_model(0, "qwen3_5")
    use_backend(model, "triton", CONTEXT)
    harness = Harness(model, PAGES, PAGE_SIZE, MAX_ACTIVE, CHUNK)
    harness.executor.close()
    harness.executor = executor = FrameExecutor(model, PAGES, PAGE_SIZE, MAX_ACTIVE, SNAPSHOTS_PER_SLOT * MAX_ACTIVE)
    cached, replies = two_turns(harness)
    assert cached >= FIRST_TURN and replies == cold[1]
    assert executor.frame_state_copies > 0 and {kind for kind, _ in executor.layouts_used} == {"decode", "extend"}


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", HYBRIDS)
def test_graph_executor_produces_the_eager_and_reference_tokens_for_each_hybrid(family: str) -> None:
    """fp32: the captured graphs' tokens are the eager kernel path's, and the torch reference's."""
    reference = tiny_model(0, family).to("cuda")
    expected = run_requests(Harness(reference, PAGES, PAGE_SIZE, MAX_ACTIVE, CHUNK, device="cuda"))
    model = tiny_model(0, family).to("cuda")
    use_backend(model, "triton", CONTEXT)
    eager = run_requests(gpu_harness(model, graphs=False))
    assert run_requests(gpu_harness(model, graphs=True)) == eager
    assert eager == expected


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", HYBRIDS)
def test_graph_executor_restores_a_hybrids_snapshot_as_its_cold_run(family: str) -> None:
    """A second turn restored from the first turn's snapshot (the row copies in the graphs' frames) equals a cold
    run in graphs (no snapshots)."""
    model = tiny_model(0, family).to("cuda")
    use_backend(model, "triton", CONTEXT)
    cached, replies = two_turns(gpu_harness(model, graphs=True))
    cold_cached, cold = two_turns(gpu_harness(model, graphs=True, snapshots=0))
    assert cached >= FIRST_TURN and cold_cached == 0
    assert replies == cold
