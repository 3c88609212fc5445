"""The hybrid models' kernels (engine/kernels/triton/short_conv.py, gated_delta_rule.py, state_copy.py, the gated
RMSNorm of rmsnorm.py, and the gated attention's kv_store.py) against their torch references (the layer's own ops): on the GPU at Qwen3.5's shapes when
there is one, otherwise under TRITON_INTERPRET=1 on the CPU at small ones (float16 stands in for bfloat16).

Every step mixes what a captured graph hands the kernels: prefill spans of lengths that are not multiples of the
64-token chunk, decode rows (one-token sequences), a padding sequence (length 0, pointing at a live row it must not
touch), a sequence of row -1, rows whose state continues and a row whose request starts (stale state it must
ignore)."""

from __future__ import annotations


import pytest
import torch

GPU = torch.cuda.is_available()
pytest.importorskip("triton")

from engine.kernels.triton.gated_delta_rule import gated_delta_rule, gated_delta_rule_reference  # noqa: E402
from engine.kernels.triton.kv_store import store_kv, store_kv_reference  # noqa: E402
from engine.kernels.triton.rmsnorm import gated_rms_norm  # noqa: E402
from engine.kernels.triton.short_conv import short_conv, short_conv_reference  # noqa: E402
from engine.kernels.triton.state_copy import copy_state_rows, copy_state_rows_reference  # noqa: E402
from engine.model.linear_attention import GatedRMSNorm  # noqa: E402
from tests.kernels.test_triton_kernels import relative_error  # noqa: E402

pytestmark = [pytest.mark.gpu] if GPU else []
DEVICE = torch.device("cuda" if GPU else "cpu")
DTYPES = [torch.bfloat16, torch.float32] if GPU else [torch.float16, torch.float32]
# (key heads, value heads, key dim, value dim): Qwen3.5's on the GPU, a small one with the same grouping here.
SHAPE = (16, 32, 128, 128) if GPU else (2, 4, 16, 32)
# Sequences: (length, tokens before); a length-0 one is a graph's padding. The GPU adds a long span.
SEQUENCES = [(70, 5), (1, 9), (3, 0), (1, 0), (0, 4), (65, 0), (2, 2)] + ([(4096 + 17, 100)] if GPU else [])
ROWS = 12


def steps(sequences: list[tuple[int, int]], seed: int) -> tuple[torch.Tensor, ...]:
    """Per sequence: its state row (distinct; the padding sequence on sequence 0's live row; sequence 1's row -1,
    its tokens written nowhere), first step row, length, tokens before it."""
    lengths = [length for length, _ in sequences]
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
    rows = torch.randperm(ROWS, generator=torch.Generator().manual_seed(seed))[:len(sequences)]
    rows[lengths.index(0)] = rows[0]  # padding points at a live row
    rows[1] = -1
    as_device = lambda values: torch.as_tensor(values, dtype=torch.int32, device=DEVICE)  # noqa: E731
    return (as_device(rows), as_device(starts), as_device(lengths), as_device([past for _, past in sequences]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_short_conv_matches_reference(dtype: torch.dtype) -> None:
    key_heads, value_heads, dk, dv = SHAPE
    channels = 2 * key_heads * dk + value_heads * dv
    rows, starts, lengths, past = steps(SEQUENCES, seed=1)
    tokens = int(lengths.sum())
    g = torch.Generator().manual_seed(2)
    product = torch.randn(tokens, channels + 40, generator=g).to(dtype).to(DEVICE)
    x = product[:, 8:8 + channels]  # a column slice of a wider fused product
    weight = (torch.randn(channels, 1, 4, generator=g) / 2).to(dtype).to(DEVICE)
    state = torch.randn(ROWS, channels, 3, generator=g).to(dtype).to(DEVICE)
    expected_state = state.clone()
    expected = short_conv_reference(x, weight, expected_state, rows, starts, lengths, past)
    out = short_conv(x, weight, state, rows, starts, lengths, past)
    assert relative_error(out, expected) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(state, expected_state)  # the state rows hold the inputs themselves


def inputs(tokens: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """The conv's output (q, k, v side by side), the a and b projections as column slices of one product, A_log,
    dt_bias, and a random float32 state."""
    key_heads, value_heads, dk, dv = SHAPE
    g = torch.Generator().manual_seed(seed)
    mixed = torch.randn(tokens, 2 * key_heads * dk + value_heads * dv, generator=g).to(dtype).to(DEVICE)
    ab = (torch.randn(tokens, 2 * value_heads, generator=g) * 2).to(dtype).to(DEVICE)
    a_log = torch.rand(value_heads, generator=g).to(DEVICE)
    dt_bias = torch.rand(value_heads, generator=g).to(dtype).to(DEVICE)
    state = (torch.randn(ROWS, value_heads, dk, dv, generator=g) / 4).to(DEVICE)
    return mixed, ab[:, :value_heads], ab[:, value_heads:], a_log, dt_bias, state


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_delta_rule_matches_reference(dtype: torch.dtype) -> None:
    rows, starts, lengths, past = steps(SEQUENCES, seed=3)
    mixed, a, b, a_log, dt_bias, state = inputs(int(lengths.sum()), dtype, seed=4)
    expected_state = state.clone()
    expected = gated_delta_rule_reference(mixed, a, b, a_log, dt_bias, expected_state, rows, starts, lengths, past,
                                          SHAPE[0])
    out = gated_delta_rule(mixed, a, b, a_log, dt_bias, state, rows, starts, lengths, past, SHAPE[0])
    # (bf16 and fp16 activations: the chunk's products in TF32 on a GPU)
    assert relative_error(out, expected) < (1e-4 if dtype == torch.float32 else 1e-2)
    assert relative_error(state, expected_state) < (1e-4 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [False, True])
def test_recurrent_delta_rule_matches_reference(dtype: torch.dtype, tokens: bool) -> None:
    """Decode rows: one token each, read from given step rows (an eager step's) or row i (a graph's), a padding
    row (past -1) on a live row, a request's first token (past 0) on stale state."""
    count = 6
    rows = torch.tensor([3, 0, 7, 5, 3, 11], dtype=torch.int32, device=DEVICE)
    past = torch.tensor([4, 0, 1, 30, -1, 2], dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([2, 0, 7, 4, 1, 5], dtype=torch.int32, device=DEVICE) if tokens else None
    mixed, a, b, a_log, dt_bias, state = inputs(8 if tokens else count, dtype, seed=5)
    expected_state, unpadded_state = state.clone(), state.clone()
    expected = gated_delta_rule_reference(mixed, a, b, a_log, dt_bias, expected_state, rows, starts, None, past,
                                          SHAPE[0])
    out = gated_delta_rule(mixed, a, b, a_log, dt_bias, state, rows, starts, None, past, SHAPE[0])
    assert relative_error(out, expected) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert relative_error(state, expected_state) < 1e-5
    live = past >= 0  # without the padding row (on row 3, after sequence 0's), row 3 ends bit for bit the same
    gated_delta_rule(mixed, a, b, a_log, dt_bias, unpadded_state, rows[live],
                     None if starts is None else starts[live], None, past[live], SHAPE[0])
    assert torch.equal(state[3], unpadded_state[3])


def test_state_copies_apply_in_order_and_skip_padding() -> None:
    g = torch.Generator().manual_seed(6)
    conv = torch.randn(3, ROWS, 40, 3, generator=g).to(DEVICE)
    delta = torch.randn(3, ROWS, 2, 16, 8, generator=g).to(DEVICE)
    # Snapshot slot 1 into row 8, restore row 9 into slot 1, then copy slot 1 on: order decides every result.
    # Past the count (4), a pair is not applied.
    pairs = torch.tensor([[1, 8], [9, 1], [-1, 2], [1, 4], [3, 4]], dtype=torch.int32, device=DEVICE)
    count = torch.tensor([4], dtype=torch.int32, device=DEVICE)
    expected = (conv.clone(), delta.clone())
    copy_state_rows_reference(expected, pairs, count)
    copy_state_rows((conv, delta), pairs, count)
    assert torch.equal(conv, expected[0]) and torch.equal(delta, expected[1])
    assert torch.equal(conv[:, 4], conv[:, 9]) and not torch.equal(conv[:, 8], conv[:, 9])


def test_store_kv_writes_live_slots_only() -> None:
    g = torch.Generator().manual_seed(7)
    kv_heads, head_dim, tokens, slots = 2, 24, 9, 32
    product = torch.randn(tokens, 3, kv_heads, head_dim, generator=g).to(DEVICE)
    k, v = product[:, 1], product[:, 2]  # strided views, as the gated attention's k and v are
    slot_mapping = torch.tensor([3, -1, 7, 0, 31, -1, 12, 5, 9], dtype=torch.int32, device=DEVICE)
    cache = torch.randn(2, slots, kv_heads, head_dim, generator=g).to(DEVICE)
    expected = cache.clone()
    store_kv_reference(k, v, slot_mapping, expected[0], expected[1])
    store_kv(k, v, slot_mapping, cache[0], cache[1])
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rms_norm_matches_the_layers_norm(dtype: torch.dtype) -> None:
    _, heads, _, dv = SHAPE
    g = torch.Generator().manual_seed(8)
    x = torch.randn(9, heads, dv, generator=g).to(dtype).to(DEVICE)
    product = torch.randn(9, heads * dv + 24, generator=g).to(dtype).to(DEVICE)
    gate = product[:, 16:16 + heads * dv]  # a column slice of the fused input product
    norm = GatedRMSNorm(dv, 1e-6).to(dtype).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(dv, generator=g) / 4)
        expected = norm(x, gate.reshape(x.shape)).flatten(1)
    out = gated_rms_norm(x, gate, norm.weight, norm.eps)
    assert relative_error(out, expected) < (1e-5 if dtype == torch.float32 else 1e-2)
