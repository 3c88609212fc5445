"""Flare's C++ decoder-layer ops for quantized CPU cores (engine/kernels/cpu/layer_ops.cpp,
engine/kernels/cpu/attention.cpp, engine/kernels/cpu/decoder_layer.cpp) against their torch references: decode
attention over pages (GQA, windows, several pages, strided q/k/v, a row's result alone and among others), the
residual add folded into RMSNorm, rotary and SiLU(gate) * up; PagedAttention with the C++ op against its SDPA path on
a step that mixes decode rows and a prefill span (a prompt's rows through the same op as decode rows); and a whole
layer in one call against the Python loop of the same ops."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from common.manifest import load_manifest
from engine.executor.eager import kv_cache_shape
from engine.kernels.cpu import extension
from engine.model.attention import AttentionMetadata, PagedAttention, PrefillSpan
from engine.model.backends import cpu_ops
from engine.model.loader import load_model
from engine.model.rotary import rotate, signed_sine

pytestmark = pytest.mark.skipif(not extension.layer_ops_ready(), reason="Flare's AVX2 kernels do not run here")
ops = torch.ops.flare_cpu
PAGE = 4


def paged_step(lengths: list[int], kv_heads: int, head_dim: int, pages: int = 16, seed: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Caches of `pages` pages filled with noise, and page tables giving each sequence its pages out of order (a
    sequence of length L ends at its own position L - 1): (k_cache, v_cache, page_tables [B, P], context_lens)."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(pages * PAGE, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(pages * PAGE, kv_heads, head_dim, generator=g)
    order = torch.randperm(pages, generator=g)
    width = max(-(-n // PAGE) for n in lengths)
    tables, used = [], 0
    for n in lengths:
        count = -(-n // PAGE)
        tables.append(order[used:used + count].tolist() + [0] * (width - count))  # padded with page 0
        used += count
    assert used <= pages
    return k_cache, v_cache, torch.tensor(tables), torch.tensor(lengths)


def slots_of(tables: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The cache slot of each sequence's last position."""
    last = lengths - 1
    return tables[torch.arange(len(lengths)), last // PAGE] * PAGE + last % PAGE


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
              lengths: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    """Each row's query heads against its keys in float64, keys gathered position by position."""
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    out = []
    for b, n in enumerate(lengths.tolist()):
        positions = torch.arange(max(0, n - window) if window else 0, n)
        slots = tables[b, positions // PAGE] * PAGE + positions % PAGE
        keys = k_cache[slots].double().repeat_interleave(heads // kv_heads, dim=1)  # [L, H, D]
        values = v_cache[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b].double(), keys) * scale
        out.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), values))
    return torch.stack(out)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 20), (8, 1, 48), (14, 2, 64)])
@pytest.mark.parametrize("window", [0, 5])
def test_decode_attention_equals_a_softmax_over_the_rows_keys(heads: int, kv_heads: int, head_dim: int,
                                                              window: int) -> None:
    """Rows of 1 to 13 keys over several pages out of order, q/k/v strided views of one fused product, the decode
    rows a subset of the step's rows (a step with a prefill span between them)."""
    lengths = [1, 13, 4, 9]
    k_cache, v_cache, tables, lens = paged_step(lengths, kv_heads, head_dim)
    g = torch.Generator().manual_seed(heads)
    steps = 6
    fused = torch.randn(steps, (heads + 2 * kv_heads) * head_dim + 3, generator=g) * 2
    q = fused[:, :heads * head_dim].view(steps, heads, head_dim)
    k = fused[:, heads * head_dim:(heads + kv_heads) * head_dim].view(steps, kv_heads, head_dim)
    v = fused[:, (heads + kv_heads) * head_dim:-3].view(steps, kv_heads, head_dim)
    rows = torch.tensor([0, 2, 3, 5])  # rows 1 and 4: another request's prompt
    slot_mapping = torch.zeros(steps, dtype=torch.int64)
    slot_mapping[rows] = slots_of(tables, lens)
    scale = head_dim ** -0.5
    out = ops.decode_attention(q, k, v, k_cache, v_cache, slot_mapping, rows, tables, lens, PAGE, scale, window)
    assert out.shape == (len(lengths), heads, head_dim)
    assert torch.equal(k_cache[slot_mapping[rows]], k[rows]) and torch.equal(v_cache[slot_mapping[rows]], v[rows])
    want = reference(q[rows], k_cache, v_cache, tables, lens, scale, window)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    # A row computed alone gets the same bits as among the others.
    for b in range(len(lengths)):
        alone = ops.decode_attention(q, k, v, k_cache, v_cache, slot_mapping, rows[b:b + 1], tables[b:b + 1],
                                     lens[b:b + 1], PAGE, scale, window)
        assert torch.equal(alone[0], out[b])


def test_decode_attention_refuses_metadata_outside_the_cache() -> None:
    k_cache, v_cache, tables, lens = paged_step([5, 3], 2, 16, pages=4)
    q, k = torch.randn(2, 4, 16), torch.randn(2, 2, 16)
    slots, rows = slots_of(tables, lens), torch.arange(2)

    def call(tables: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return ops.decode_attention(q, k, k, k_cache, v_cache, slots, rows, tables, lens, PAGE, 0.25, 0)

    with pytest.raises(RuntimeError, match="page 9 outside"):
        call(torch.tensor([[0, 9], [1, 0]]), lens, slots)
    with pytest.raises(RuntimeError, match="context length 12"):
        call(tables, torch.tensor([12, 3]), slots)
    with pytest.raises(RuntimeError, match="slot 99"):
        call(tables, lens, torch.tensor([99, 0]))
    with pytest.raises(RuntimeError, match="page table 2 outside"):
        ops.decode_attention(q, k, k, k_cache, v_cache, slots, rows, tables, lens, PAGE, 0.25, 0, torch.tensor([1, 2]))


def test_paged_attention_with_the_decode_op_equals_its_sdpa_path() -> None:
    """A step of two decode rows around a prefill span of 5 tokens, every row through the C++ op: outputs within
    fp32 rounding of SDPA's, the caches get the same keys and values, and each of the span's rows gets the bits of
    a decode row at its position (its keys already in the cache)."""
    heads, kv_heads, head_dim = 6, 2, 32
    k_cache, v_cache, tables, lens = paged_step([7, 10, 6], kv_heads, head_dim, seed=1)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(7, n, head_dim, generator=g) for n in (heads, kv_heads, kv_heads))
    prompt = torch.arange(1, 6)  # the prefill's 5 tokens at positions 5..9 of sequence 1
    positions = torch.arange(5, 10)
    slot_mapping = torch.cat([slots_of(tables[:1], lens[:1]),
                              tables[1, positions // PAGE] * PAGE + positions % PAGE, slots_of(tables[2:], lens[2:])])
    meta = AttentionMetadata(slot_mapping, torch.tensor([0, 6]), tables[[0, 2]], lens[[0, 2]],
                             (PrefillSpan(int(prompt[0]), 5, 10, tables[1]),), PAGE)
    attention = PagedAttention(heads, kv_heads, head_dim ** -0.5)
    caches = k_cache.clone(), v_cache.clone()
    want = attention(q, k, v, *caches, meta)
    got = cpu_ops.paged_attention(attention, q, k, v, k_cache, v_cache, meta)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(k_cache, caches[0]) and torch.equal(v_cache, caches[1])
    for row, position in zip(prompt.tolist(), positions.tolist()):
        alone = ops.decode_attention(q, k, v, k_cache, v_cache, slot_mapping, torch.tensor([row]), tables[1:2],
                                     torch.tensor([position + 1]), PAGE, head_dim ** -0.5, 0)
        assert torch.equal(alone[0], got[row])


@pytest.mark.parametrize("shape", [(1, 576), (7, 3, 64), (2, 19)])
def test_rms_norm_and_its_residual_add_equal_the_exact_norm(shape: tuple[int, ...]) -> None:
    """Rows of any width (a tail past 8 lanes) and strided inputs (Qwen3's per-head norms take slices of the fused
    q/k/v), against float64; the residual sum is bitwise aten's add."""
    torch.manual_seed(len(shape))
    x = (torch.randn(*shape[:-1], 2 * shape[-1]) * 3)[..., ::2]
    residual = torch.randn(shape)
    weight = torch.rand(shape[-1]) + 0.5

    def exact(v: torch.Tensor) -> torch.Tensor:
        return v.double() * torch.rsqrt(v.double().pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()

    normed = ops.rms_norm(x, weight, 1e-5)
    assert normed.shape == x.shape
    torch.testing.assert_close(normed.double(), exact(x), rtol=2e-6, atol=1e-6)
    normed, summed = ops.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, x + residual)
    torch.testing.assert_close(normed.double(), exact(x + residual), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("head_dim", [64, 48, 20])
def test_rotary_is_bitwise_rotate(head_dim: int) -> None:
    """q and k heads as a strided view of a fused product; halves of 32, 24 (whole vectors) and 10 lanes."""
    torch.manual_seed(head_dim)
    tokens, heads = 5, 7
    fused = torch.randn(tokens, (heads + 2) * head_dim)
    qk = fused[:, :heads * head_dim].view(tokens, heads, head_dim)
    angles = torch.randn(tokens, head_dim // 2) * 30
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos()[:, None, :], signed_sine(angles.sin())[:, None, :]
    assert torch.equal(ops.rotary(qk, cos, sin), rotate(qk, cos, sin))


@pytest.mark.parametrize("rows, width", [(1, 1536), (3, 13)])
def test_silu_mul_equals_silu_of_gate_times_up(rows: int, width: int) -> None:
    """The fused [gate | up] product, rows strided (a view of a wider tensor); a width with a scalar tail."""
    torch.manual_seed(width)
    gate_up = (torch.randn(rows, 2 * width + 5) * 6)[:, :2 * width]
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), torch.nn.functional.silu(gate) * up, rtol=4e-7, atol=1e-7)


def test_whole_decoder_layers_equal_the_layer_loop(core_dir: Path) -> None:
    """The quantized core's decode step with each layer one flare_cpu::decoder_layer call gets the bits of the same
    step through the Python layer loop of the same ops, for two sequences of different lengths over several pages."""
    if not load_manifest(core_dir).quantization:
        pytest.skip(f"{core_dir} is not a quantized core")
    _, model = load_model(core_dir, torch.device("cpu"))
    layers = model.model.layers
    backend = model.backend
    assert isinstance(backend, cpu_ops.CpuOps) and all(weights is not None for weights in backend.whole_layers)
    assert len(backend.whole_layers) == len(layers)
    kv = torch.zeros(kv_cache_shape(model, 8, PAGE))
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    lengths = [9, 13]
    torch.manual_seed(0)
    prompt = torch.randint(0, 1000, (sum(lengths),))
    positions = torch.cat([torch.arange(n) for n in lengths])
    slots = torch.cat([tables[i, torch.arange(n) // PAGE] * PAGE + torch.arange(n) % PAGE
                       for i, n in enumerate(lengths)])
    spans = (PrefillSpan(0, 9, 9, tables[0]), PrefillSpan(9, 13, 13, tables[1]))
    empty = torch.empty(0, dtype=torch.int64)
    with torch.inference_mode():
        model(prompt, positions, kv, AttentionMetadata(slots, empty, tables[:0], empty, spans, PAGE))
        lens = torch.tensor(lengths) + 1
        meta = AttentionMetadata(slots_of(tables, lens), torch.arange(2), tables, lens, (), PAGE)
        tokens, positions = torch.tensor([5, 7]), lens - 1
        whole = model(tokens, positions, kv, meta)
        layer_loop = replace(backend, whole_layers=(None,) * len(layers))
        assert torch.equal(layer_loop.forward(model, tokens, positions, kv, meta, None), whole)
