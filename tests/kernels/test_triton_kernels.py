"""Each Triton kernel against its torch reference on fresh random inputs: on the GPU when there is one, otherwise
under TRITON_INTERPRET=1 on the CPU at small sizes (the interpreter has no bfloat16 dot, so float16 stands in)."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

GPU = torch.cuda.is_available()
pytest.importorskip("triton")

from engine.kernels.triton import dependent_launch  # noqa: E402
from engine.kernels.triton.activation import silu_and_mul, silu_and_mul_reference  # noqa: E402
from engine.kernels.triton.decode_attention import (NewTokens, decode_attention, decode_attention_reference,  # noqa: E402
                                                    num_splits)
from engine.kernels.triton.extend_attention import extend_attention, extend_attention_reference, extend_blocks  # noqa: E402
from engine.kernels.triton.fused_moe import (MoeConfig, align_in_one_program, align_with_torch, fused_moe,  # noqa: E402
                                             fused_moe_reference)
from engine.kernels.triton.gemv import MAX_ROWS, GemvConfig, gemv, gemv_reference  # noqa: E402
from engine.kernels.triton.moe_routing import route, route_in_one_program  # noqa: E402
from engine.kernels.triton.moe_rows import ROWS_MAX_PAIRS, ExpertScales, RowsConfig  # noqa: E402
from engine.kernels.triton.page_table import apply_patches, apply_patches_reference  # noqa: E402
from engine.kernels.triton.penalties import process_logits, process_logits_reference  # noqa: E402
from engine.kernels.triton.rmsnorm import add_rms_norm, add_rms_norm_reference  # noqa: E402
from engine.kernels.triton.rotary import head_rms_norm_reference, rope_and_store, rope_and_store_reference, rope_table  # noqa: E402
from engine.model.fp8 import rows_expanded  # noqa: E402
from tests.support.fp8_checkpoints import block_quantized, channel_quantized  # noqa: E402

# On a GPU these are GPU tests (`pytest -m gpu` selects them); on the CPU they run in CI under the interpreter.
pytestmark = [pytest.mark.gpu] if GPU else []
DEVICE = torch.device("cuda" if GPU else "cpu")
DTYPES = [torch.bfloat16, torch.float16, torch.float32] if GPU else [torch.float16, torch.float32]
# (heads, kv heads, head dim, page size): Llama-3.1-8B's shape on the GPU, a small grouped one on the CPU.
SHAPES = [(32, 8, 128, 64), (9, 3, 64, 64)] if GPU else [(4, 2, 32, 16), (3, 1, 16, 16)]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any()
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-12))


def tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 2e-2


def random_pages(contexts: list[int], page_size: int, generator: torch.Generator) -> torch.Tensor:
    """One row of shuffled, distinct pages per sequence, padded with page 0."""
    needed = [-(-c // page_size) for c in contexts]
    order = torch.randperm(sum(needed) + 3, generator=generator)
    width = max(max(needed), 1)
    tables = torch.zeros(len(contexts), width, dtype=torch.int32)
    used = 0
    for i, n in enumerate(needed):
        tables[i, :n] = order[used:used + n]
        used += n
    return tables


def random_cache(slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    kv = torch.randn(2, slots, kv_heads, head_dim, generator=generator).to(dtype)
    return kv[0].to(DEVICE), kv[1].to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", [0, 37])
def test_decode_attention_matches_reference(dtype: torch.dtype, shape: tuple[int, int, int, int],
                                            window: int) -> None:
    heads, kv_heads, head_dim, page = shape
    g = torch.Generator().manual_seed(hash((dtype, shape)) % 2**31)
    contexts = [1, page - 1, page, 3 * page + 5, 0, 2 * page + 1] if not GPU else [1, 63, 64, 1000, 0, 4097, 300, 2]
    tables = random_pages(contexts, page, g)
    k_cache, v_cache = random_cache((int(tables.max()) + 1) * page, kv_heads, head_dim, dtype, g)
    q = torch.randn(len(contexts), heads, head_dim, generator=g).to(dtype).to(DEVICE)
    # Rows of the table are named through seq_table, as the graph executor names slots: reverse them.
    seq_table = torch.arange(len(contexts) - 1, -1, -1, dtype=torch.int32)
    tables = tables.flip(0).contiguous()
    args = (q, k_cache, v_cache, tables.to(DEVICE), seq_table.to(DEVICE),
            torch.tensor(contexts, dtype=torch.int32, device=DEVICE), page, head_dim**-0.5)
    ref = decode_attention_reference(*args, window=window)
    if window:  # the window changes the answer wherever the context is longer than it
        assert relative_error(decode_attention_reference(*args), ref) > 0.05
    for splits in sorted({1, 4, num_splits(len(contexts), kv_heads, 132 if GPU else 2)}):
        out = decode_attention(*args, splits=splits, window=window)
        assert relative_error(out, ref) < tolerance(dtype), splits
        assert torch.equal(out[contexts.index(0)], torch.zeros_like(out[0]))


def extend_case(shape: tuple[int, int, int, int], dtype: torch.dtype, spans: list[tuple[int, int]],
                g: torch.Generator) -> tuple:
    """Random queries and paged caches for (new tokens, cached prefix) spans, and the kernel's metadata."""
    heads, kv_heads, head_dim, page = shape
    lengths = [n for n, _ in spans]
    contexts = [n + cached for n, cached in spans]
    tables = random_pages(contexts, page, g)
    k_cache, v_cache = random_cache((int(tables.max()) + 1) * page, kv_heads, head_dim, dtype, g)
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
    tokens = sum(lengths) + 3  # rows past the last sequence belong to nobody and stay as they were
    q = torch.randn(tokens, heads, head_dim, generator=g).to(dtype).to(DEVICE)
    as_int = lambda values: torch.tensor(values, dtype=torch.int32, device=DEVICE)  # noqa: E731
    meta = (tables.to(DEVICE), as_int(list(range(len(spans)))), as_int(starts.tolist()), as_int(lengths),
            as_int(contexts))
    block_seq, block_first = extend_blocks(lengths)
    padding = 2  # padding blocks (sequence -1) do nothing
    blocks = (as_int(block_seq + [-1] * padding), as_int(block_first + [0] * padding))
    return q, k_cache, v_cache, meta, blocks


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", [0, 50])
def test_extend_attention_matches_reference(dtype: torch.dtype, shape: tuple[int, int, int, int],
                                            window: int) -> None:
    page, head_dim = shape[3], shape[2]
    g = torch.Generator().manual_seed(hash((dtype, shape, "extend")) % 2**31)
    # (new tokens, cached prefix) per sequence: a fresh prompt, a chunk after a cached prefix, decode rows.
    # Blocks of every size: full (over 64 rows), short (17-64: a prompt's tail, 64 new tokens) and narrow (<= 16).
    spans = ([(5, 0), (70, page), (1, 2 * page + 3), (130, 7), (1, 0), (3, 300), (12, 2 * page + 5), (40, 300)]
             if not GPU else
             [(512, 0), (300, 1024), (1, 77), (64, 64), (1000, 33), (1, 0), (64, 5000), (1, 9000), (13, 4000)])
    q, k_cache, v_cache, meta, blocks = extend_case(shape, dtype, spans, g)
    ref = extend_attention_reference(q, k_cache, v_cache, *meta, page, head_dim**-0.5, window=window)
    if window:
        assert relative_error(extend_attention_reference(q, k_cache, v_cache, *meta, page, head_dim**-0.5), ref) > 0.05
    new = sum(n for n, _ in spans)
    # The GPU's own program count, and one so large that long blocks' keys are split (then merged), up to the
    # default most splits and past it; on the CPU a window keeps keys too few to split.
    cases = [(None, 16), (10**4, 16), (10**4, 64)] if GPU else [(None, 16)] if window else \
        [(None, 16), (112, 16), (112, 2)]
    for programs, most in cases:
        out = torch.full_like(q, 7.0)
        extend_attention(q, k_cache, v_cache, out, *meta, *blocks, page, head_dim**-0.5, window=window,
                         programs=programs, max_splits=most)
        assert relative_error(out[:new], ref[:new]) < tolerance(dtype), (programs, most)
        assert (out[new:] == 7.0).all()
    # A graph lists padding blocks after the live ones; the eager step does not: the same numbers either way.
    unpadded = torch.full_like(q, 7.0)
    live = int((blocks[0] >= 0).sum())
    extend_attention(q, k_cache, v_cache, unpadded, *meta, blocks[0][:live], blocks[1][:live], page,
                     head_dim**-0.5, window=window, programs=programs, max_splits=most)
    assert torch.equal(unpadded, out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_mixed_eager_step_computes_what_its_graph_computes(dtype: torch.dtype) -> None:
    """Decode rows beside prefill spans: the eager step's metadata (AttentionMetadata.kernel) and a captured extend
    graph's (every row a sequence, in row order, padding tokens and blocks after) give the same bits."""
    from engine.model.attention import AttentionMetadata, ExtendBatch, KernelMetadata, PrefillSpan
    from engine.model.backends.triton_layers import kernel_attention

    heads, kv_heads, head_dim, page = SHAPES[0]
    g = torch.Generator().manual_seed(5)
    rows = [(1, 90), (6, 110), (1, 33), (9, 0)] if not GPU else [(1, 900), (300, 1100), (1, 3300), (64, 0)]
    contexts = [n + cached for n, cached in rows]
    tables = random_pages(contexts, page, g).long()
    k_cache, v_cache = random_cache((int(tables.max()) + 1) * page, kv_heads, head_dim, dtype, g)
    starts = torch.tensor([0] + [n for n, _ in rows][:-1]).cumsum(0).tolist()
    tokens = sum(n for n, _ in rows)
    q = torch.randn(tokens + 5, heads, head_dim, generator=g).to(dtype).to(DEVICE)  # a graph's padded rows
    decode = [i for i, (n, _) in enumerate(rows) if n == 1]
    as_long = lambda values: torch.tensor(values, dtype=torch.int64, device=DEVICE)  # noqa: E731
    eager = AttentionMetadata(
        as_long(list(range(tokens))), as_long([starts[i] for i in decode]), tables[decode].to(DEVICE),
        as_long([contexts[i] for i in decode]),
        tuple(PrefillSpan(starts[i], n, contexts[i], tables[i].to(DEVICE)) for i, (n, _) in enumerate(rows)
              if n > 1), page)
    as_int = lambda values: torch.tensor(values, dtype=torch.int32, device=DEVICE)  # noqa: E731
    block_seq, block_first = extend_blocks([n for n, _ in rows])
    graph = KernelMetadata(as_long(list(range(tokens + 5))), page, extend=ExtendBatch(
        tables.to(DEVICE), as_int(list(range(len(rows)))), as_int(starts), as_int([n for n, _ in rows]),
        as_int(contexts), as_int(block_seq + [-1] * 3), as_int(block_first + [0] * 3)))
    scale = head_dim**-0.5
    assert torch.equal(kernel_attention(q[:tokens], k_cache, v_cache, eager.kernel, scale),
                       kernel_attention(q, k_cache, v_cache, graph, scale)[:tokens])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_style", [None, "llama", "gemma"])
def test_rope_and_store_matches_reference(dtype: torch.dtype, norm_style: str | None) -> None:
    heads, kv_heads, head_dim = (32, 8, 128) if GPU else (4, 2, 32)
    g = torch.Generator().manual_seed(3)
    tokens, slots = 37, 64
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    table = rope_table(inv_freq, 4096).to(DEVICE)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype).to(DEVICE)
    positions = torch.randint(0, 4096, (tokens,), generator=g).to(DEVICE)
    slot_mapping = torch.randperm(slots, generator=g)[:tokens].to(torch.int32)
    slot_mapping[::5] = -1  # padding tokens write nowhere
    slot_mapping = slot_mapping.to(DEVICE)
    cache = torch.randn(2, slots, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    caches = [cache, cache.clone()]
    norms = {}
    if norm_style:  # Qwen3's or Gemma 3's per-head RMSNorm of q and k before the rotation
        weights = (torch.randn(2, head_dim, generator=g) * 0.5 + (norm_style == "llama")).to(dtype).to(DEVICE)
        norms = dict(q_norm=weights[0], k_norm=weights[1], norm_eps=1e-6, norm_style=norm_style)
    q = rope_and_store(qkv, positions, table, slot_mapping, caches[0][0], caches[0][1], heads, kv_heads, **norms)
    q_ref = rope_and_store_reference(qkv, positions, table, slot_mapping, caches[1][0], caches[1][1], heads,
                                     kv_heads, **norms)
    assert relative_error(q, q_ref) < tolerance(dtype) / 10
    assert relative_error(caches[0], caches[1]) < tolerance(dtype) / 10


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_head_rms_norm_reference_matches_transformers(family: str) -> None:
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    norm = Qwen3RMSNorm(32, eps=1e-6) if family == "qwen3" else Gemma3RMSNorm(32, eps=1e-6)
    torch.nn.init.normal_(norm.weight)
    for dtype in (torch.float32, torch.bfloat16):
        norm = norm.to(dtype)
        x = torch.randn(5, 3, 32).to(dtype)
        with torch.no_grad():
            expected = norm(x)
        out = head_rms_norm_reference(x, norm.weight.data, 1e-6, "llama" if family == "qwen3" else "gemma")
        assert out.dtype == expected.dtype and torch.allclose(out.float(), expected.float(), rtol=1e-2, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(4)
    size = 4096 if GPU else 576
    x, residual, weight = (torch.randn(*shape, generator=g).to(dtype).to(DEVICE) for shape in
                           ((9, size), (9, size), (size,)))
    for res in (None, residual):
        out, summed = add_rms_norm(x, res, weight, 1e-5)
        ref, ref_summed = add_rms_norm_reference(x, res, weight, 1e-5)
        assert relative_error(out, ref) < tolerance(dtype) / 10
        assert torch.equal(summed, ref_summed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 2 * (14336 if GPU else 1536), generator=g).to(dtype).to(DEVICE)
    assert relative_error(silu_and_mul(x), silu_and_mul_reference(x)) < tolerance(dtype) / 10


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fusion", ["plain", "norm", "silu_mul", "bias_residual"])
@pytest.mark.parametrize("fp8", [None, "channel", "block"])
def test_gemv_matches_reference(dtype: torch.dtype, fusion: str, fp8: str | None) -> None:
    """fp8: the weight as e4m3 values with a scale per output row, or per block of 16 rows and 32 columns."""
    g = torch.Generator().manual_seed(12)
    # (N, K): the 8B's q/k/v and down on the GPU; on the CPU, N not a multiple of BLOCK_N and K of BLOCK_K too
    shapes = [(6144, 4096), (4096, 14336)] if GPU else [(40, 64), (24, 80)]
    config = GemvConfig(16, 256, 4, 3) if GPU else GemvConfig(16, 32, 4, 1)
    for (n_out, k_in), rows in zip(shapes, (1, MAX_ROWS - 1)):
        width = 2 * k_in if fusion == "silu_mul" else k_in
        x, weight, bias, norm_weight, residual = (torch.randn(*shape, generator=g).to(dtype).to(DEVICE) for shape
                                                  in ((rows, width), (n_out, k_in), (n_out,), (k_in,), (rows, n_out)))
        weight /= k_in ** 0.5
        kwargs = dict(norm=(norm_weight, 1e-6) if fusion == "norm" else None, silu_mul=fusion == "silu_mul")
        if fp8 == "channel":
            weight, scale = channel_quantized(weight.float())
            kwargs.update(scale=scale.to(DEVICE))
        elif fp8 == "block":
            weight, scale = block_quantized(weight.float(), (16, 32))
            kwargs.update(scale=rows_expanded(scale, n_out, 16).to(DEVICE), scale_k=32)
        if fusion == "bias_residual":
            kwargs.update(bias=bias, residual=residual)
        ref = gemv_reference(x, weight, **kwargs)
        out = gemv(x, weight, config=config, **kwargs)
        assert out.shape == ref.shape and relative_error(out, ref) < tolerance(dtype) / 4
        if fusion == "bias_residual":
            assert out.data_ptr() == residual.data_ptr()


@pytest.mark.skipif(not GPU or not dependent_launch.supported(DEVICE),
                    reason="dependent launches need a GPU of compute capability 9 or later")
@pytest.mark.parametrize("dependent", [dependent_launch.WAIT_FIRST, dependent_launch.PREFETCH,
                                       dependent_launch.PREFETCH_EARLY])
def test_dependent_gemv_launches_in_a_graph_equal_plain_ones(dependent: int) -> None:
    """Every product reads the one before it, and half add to a residual the others read: a program that read or
    wrote before the kernel before it had finished would change the numbers."""
    g = torch.Generator().manual_seed(13)
    weights = [(torch.randn(4096, 4096, generator=g) / 64).bfloat16().to(DEVICE) for _ in range(8)]
    norm = (1 + 0.1 * torch.randn(4096, generator=g)).bfloat16().to(DEVICE)
    x = torch.randn(1, 4096, generator=g).bfloat16().to(DEVICE)

    def chain(kind: int) -> torch.Tensor:
        residual = x.clone()
        for first, second in zip(weights[::2], weights[1::2]):
            gemv(gemv(residual, first, norm=(norm, 1e-6), dependent=kind), second, residual=residual, dependent=kind)
        return residual

    plain = chain(dependent_launch.NONE)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain(dependent)  # compiled outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(dependent)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, plain)


def test_apply_patches_matches_reference() -> None:
    g = torch.Generator().manual_seed(6)
    table = torch.randint(0, 100, (65, 129), generator=g, dtype=torch.int32).to(DEVICE)
    index = torch.randperm(table.numel(), generator=g)[:3000].to(torch.int32)
    pairs = torch.stack((index, torch.randint(0, 10**6, (3000,), generator=g, dtype=torch.int32)), 1).flatten()
    patches = torch.cat((pairs, torch.full((50,), 5, dtype=torch.int32))).to(DEVICE)  # stale entries past count
    count = torch.tensor([2500], dtype=torch.int32, device=DEVICE)
    expected = table.clone()
    apply_patches_reference(expected, patches, count)
    apply_patches(table, patches, count)
    assert torch.equal(table, expected)


def test_process_logits_matches_reference() -> None:
    """Rows with and without penalties, masks and bans (Llama 3's vocabulary on the GPU): the penalised logits
    within an ulp or so (a fused multiply-subtract), the same tokens forbidden."""
    rows, vocab, slots = (64, 128256, 80) if GPU else (6, 1000, 4)
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(DEVICE)
    state = torch.randint(0, slots, (rows,), generator=g).to(DEVICE)
    counts = (torch.randint(0, 4, (slots, vocab), generator=g, dtype=torch.int32)
              * (torch.rand(slots, vocab, generator=g) < 0.1)).to(DEVICE)
    seen = (counts > 0) | (torch.rand(slots, vocab, generator=g) < 0.05).to(DEVICE)
    asks = torch.arange(rows) % 3 == 0  # a third ask for penalties; the others carry the neutral values
    presence = torch.where(asks, torch.rand(rows, generator=g) * 2, 0.0).to(DEVICE)
    frequency = torch.where(asks, torch.rand(rows, generator=g), 0.0).to(DEVICE)
    repetition = torch.where(asks, 1 + torch.rand(rows, generator=g), 1.0).to(DEVICE)
    masks = torch.randint(-2**31, 2**31 - 1, (rows, (vocab + 31) // 32), generator=g, dtype=torch.int32)
    masks[::2] = -1  # unconstrained rows
    banned = torch.randint(0, vocab, (rows, 16), generator=g, dtype=torch.int32)
    banned[torch.rand(rows, 16, generator=g) < 0.5] = -1
    masks, banned = masks.to(DEVICE), banned.to(DEVICE)
    args = (logits, state, counts, seen, presence, frequency, repetition, masks, banned)
    penalised, processed = process_logits(*args)
    expected, expected_processed = process_logits_reference(*args)
    assert torch.equal(penalised[~asks.to(DEVICE)], logits[~asks.to(DEVICE)])  # neutral rows bit for bit
    torch.testing.assert_close(penalised, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(processed.isinf(), expected_processed.isinf())
    torch.testing.assert_close(processed, expected_processed, rtol=1e-6, atol=1e-6)


# (hidden, intermediate, experts, top k): Qwen3-30B-A3B's MoE on the GPU, a small one on the CPU.
MOE_SHAPE = (2048, 768, 128, 8) if GPU else (64, 32, 8, 2)


def moe_inputs(shape: tuple[int, int, int, int], tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """x, w13, w2, router logits [T, E] (float32) in which some experts get no token at all."""
    hidden, inter, experts, top_k = shape
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).to(dtype).to(DEVICE)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype).to(DEVICE)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(dtype).to(DEVICE)
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, : experts // 2] -= 4
    return x, w13, w2, logits.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 16, 256] + ([8192] if GPU else []))
@pytest.mark.parametrize("path", ["chosen", "grouped"])
def test_fused_moe_matches_reference(dtype: torch.dtype, tokens: int, path: str) -> None:
    """moe_config's choice (the rows path up to 16 tokens of this shape, the grouped GEMM at 256 and at a server's
    whole step budget, 8,192 tokens) and the grouped GEMM forced at every batch."""
    x, w13, w2, logits = moe_inputs(MOE_SHAPE, tokens, dtype)
    weights, ids = route(logits, MOE_SHAPE[3], renormalize=True)
    config = {"chosen": None, "grouped": MoeConfig(16, 64, 64, 1, 4, 2)}[path]
    out = fused_moe(x, w13, w2, weights, ids, config)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert relative_error(out, fused_moe_reference(x, w13, w2, weights, ids)) < tolerance(dtype) / 2
    residual = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    summed = fused_moe(x, w13, w2, weights, ids, config, residual=residual.clone())
    assert torch.equal(summed, out + residual)  # the in-place add rounds as the unfused one


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_rows_path_masks_ragged_shapes(dtype: torch.dtype) -> None:
    """Sizes that are no multiple of the rows path's blocks (hidden 78 = 2.4 slices of 32 and 19.5 blocks of the
    down kernel's 4 columns, 24 intermediate columns in blocks of 16) and a top k that is no power of two, at the
    largest pair count that takes the rows path."""
    shape = (78, 24, 8, 3)
    x, w13, w2, logits = moe_inputs(shape, ROWS_MAX_PAIRS // shape[3], dtype)
    weights, ids = route(logits, shape[3], renormalize=True)
    out = fused_moe(x, w13, w2, weights, ids, RowsConfig(16, 32, 4, 2))
    assert relative_error(out, fused_moe_reference(x, w13, w2, weights, ids)) < tolerance(dtype) / 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3])
def test_moe_rows_path_normalises_the_residual_stream_itself(dtype: torch.dtype, tokens: int) -> None:
    """Given the stream and the norm before the experts (a batch-1 step's MoE layer, engine/model/backends/
    few_rows.py), the rows path's output is the reference's over add_rms_norm of the stream, within the tolerance
    of not rounding the normalised row first (as gemv's RMSNorm prologue), added to the stream in place."""
    x, w13, w2, logits = moe_inputs(MOE_SHAPE, tokens, dtype)
    weights, ids = route(logits, MOE_SHAPE[3], renormalize=True)
    norm = ((torch.randn(MOE_SHAPE[0], generator=torch.Generator().manual_seed(2)) * 0.3 + 1).to(dtype).to(DEVICE),
            1e-6)
    want = fused_moe_reference(add_rms_norm_reference(x, None, *norm)[0], w13, w2, weights, ids)
    stream = x.clone()
    got = fused_moe(stream, w13, w2, weights, ids, residual=stream, norm=norm)
    assert got is stream
    assert relative_error(got.float() - x.float(), want) < tolerance(dtype)


@pytest.mark.parametrize("block", [None, (16, 32)])
@pytest.mark.parametrize("tokens", [2, 64])
def test_fused_moe_over_fp8_experts_matches_the_reference_on_their_dequantized_weights(
        tokens: int, block: tuple[int, int] | None) -> None:
    """e4m3 experts with a scale per row (`--quant fp8`) or per block (FP8 checkpoints; the scales expanded to rows as
    the kernels read them), on the rows path (2 tokens) and the grouped one (64): the reference multiplies by the
    weights dequantized in the activations' dtype."""
    dtype = DTYPES[0]
    x, w13, w2, logits = moe_inputs(MOE_SHAPE, tokens, torch.float32)
    weights, ids = route(logits, MOE_SHAPE[3], renormalize=True)
    (v13, d13), (v2, d2), scales = fp8_experts(w13, w2, block)
    x = x.to(dtype)
    out = fused_moe(x, v13, v2, weights, ids, scales=scales)
    reference = fused_moe_reference(x, d13.to(dtype), d2.to(dtype), weights, ids)
    assert relative_error(out, reference) < tolerance(dtype) / 2


def fp8_experts(w13: torch.Tensor, w2: torch.Tensor, block: tuple[int, int] | None
                ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor], ExpertScales]:
    """Expert stacks quantized with a scale per row or per block: (e4m3 values, their fp32 dequantization) of each,
    and the scales as the kernels read them, on the test's device."""
    parts, kernel_scales = [], []
    for weight in (w13, w2):
        if block is None:
            values, scale = channel_quantized(weight)
            parts.append((values.to(DEVICE), (values.float() * scale).to(DEVICE)))
        else:
            values, scale = block_quantized(weight, block)
            scale = rows_expanded(scale, weight.shape[-2], block[0])
            dense = values.float() * scale.repeat_interleave(block[1], -1)[..., :weight.shape[-1]]
            parts.append((values.to(DEVICE), dense.to(DEVICE)))
        kernel_scales.append(scale.to(DEVICE))
    return parts[0], parts[1], ExpertScales(*kernel_scales, None if block is None else block[1])


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("shape", [(1, 8, 2), (5, 60, 6), (33, 128, 8)])
def test_route_in_one_program_matches_route(shape: tuple[int, int, int], renormalize: bool) -> None:
    """The same experts in the same order (largest first) and the same weights as torch's softmax, topk and sum
    (float32 logits: no ties, whose order torch.topk leaves open)."""
    tokens, experts, top_k = shape
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(experts)).to(DEVICE)
    weights, ids = route_in_one_program(logits, top_k, renormalize)
    expected_weights, expected_ids = route(logits, top_k, renormalize)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)


def test_route_in_one_program_breaks_ties_by_the_lowest_expert() -> None:
    """bfloat16 router logits tie often (and a graph's padding rows are all ties): the lowest ids win, in order."""
    logits = torch.tensor([[0.5, 2.0, 0.5, 2.0, 0.5, 0.5]], dtype=torch.bfloat16, device=DEVICE)
    weights, ids = route_in_one_program(logits, 4, renormalize=False)
    assert ids.tolist() == [[1, 3, 0, 2]]
    assert weights[0, 0] == weights[0, 1] and weights[0, 2] == weights[0, 3] < weights[0, 0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_route_in_one_program_names_only_experts_for_non_finite_logits(bad: float) -> None:
    """A row of NaN (a graph's padding row holds whatever its memory held) once routed to expert E_POW2, past the
    experts: the grouped path's sort then indexed out of bounds, a device-side assert that poisoned the engine."""
    experts, top_k = 60, 8
    logits = torch.randn(4, experts, generator=torch.Generator().manual_seed(1))
    logits[1] = bad
    logits[2, ::3] = bad
    _, ids = route_in_one_program(logits.to(DEVICE), top_k, renormalize=True)
    assert ((ids >= 0) & (ids < experts)).all()
    finite = torch.isfinite(logits).all(dim=1)
    assert torch.equal(ids[finite.to(DEVICE)], route(logits[finite], top_k, True)[1].to(DEVICE))


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_moe_norm", "mixtral"])
def test_route_and_moe_reference_match_transformers(family: str) -> None:
    """route + fused_moe_reference on a transformers MoE block's own weights give that block's output (fp32)."""
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(7)
    if family == "mixtral":
        block = MixtralSparseMoeBlock(transformers.MixtralConfig(hidden_size=64, intermediate_size=32,
                                                                 num_local_experts=8, num_experts_per_tok=2))
    else:
        block = Qwen3MoeSparseMoeBlock(transformers.Qwen3MoeConfig(
            hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=family == "qwen3_moe_norm"))
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.1)
    x = torch.randn(1, 23, 64)
    with torch.no_grad():
        expected = block(x)
        expected = (expected[0] if isinstance(expected, tuple) else expected).reshape(23, 64)
        weights, ids = route(torch.nn.functional.linear(x[0], block.gate.weight), 2,
                             renormalize=family != "qwen3_moe")
        out = fused_moe_reference(x[0], block.experts.gate_up_proj, block.experts.down_proj, weights, ids)
    assert torch.allclose(out, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("pairs", [2, 40, 300, 2048])
def test_align_by_expert_one_program_matches_torch(pairs: int) -> None:
    g = torch.Generator().manual_seed(pairs)
    for experts, block_m in ((8, 16), (128, 16), (60, 64)):
        ids = torch.randint(0, experts // 3 if pairs == 300 else experts, (pairs,), generator=g,
                            dtype=torch.int32).to(DEVICE)
        one = align_in_one_program(ids, experts, block_m)
        with_torch = align_with_torch(ids, experts, block_m)
        for a, b in zip(one, with_torch):
            assert torch.equal(a.cpu(), b.cpu()), (experts, block_m)
        sorted_pairs, block_expert, total = (t.cpu() for t in one)
        live = sorted_pairs[sorted_pairs < pairs].long()
        assert sorted(live.tolist()) == list(range(pairs))  # every pair once
        for row in range(int(total)):  # each pair sits in a block of its own expert
            if sorted_pairs[row] < pairs:
                assert ids.cpu()[sorted_pairs[row]] == block_expert[row // block_m]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_style", [None, "llama", "gemma"])
@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype-cache", "fp8-cache"])
def test_decode_attention_of_new_tokens_rotates_and_stores_them_as_rope_and_store(
        dtype: torch.dtype, norm_style: str | None, window: int, fp8: bool) -> None:
    """The decode kernel given the q/k/v product: the same cache bytes and the same output, bit for bit, as
    rope_and_store followed by the decode kernel, at every split count (a padding row of context 0 and slot -1
    stores nothing and gives zeros); with per-head norms on a GPU, the same to the dtype's rounding."""
    from engine.model.kv_quant import quantize

    heads, kv_heads, head_dim, page = SHAPES[0]
    g = torch.Generator().manual_seed(hash((dtype, norm_style, window, "new")) % 2**31)
    contexts = [1, page - 1, page, 3 * page + 5, 0, 2 * page + 1] if not GPU else [1, 63, 64, 1000, 0, 4097, 300, 2]
    tables = random_pages(contexts, page, g)
    k_cache, v_cache = random_cache((int(tables.max()) + 1) * page, kv_heads, head_dim, dtype, g)
    kv_scale = None
    if fp8:
        kv_scale = (torch.rand(2, kv_heads, generator=g) * 1.5 + 0.25).to(DEVICE)
        k_cache, v_cache = quantize(k_cache.float() * 4, kv_scale[0]), quantize(v_cache.float() * 4, kv_scale[1])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    table = rope_table(inv_freq, 8192).to(DEVICE)
    qkv = torch.randn(len(contexts), (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype).to(DEVICE)
    positions = torch.tensor([max(c - 1, 0) for c in contexts], device=DEVICE)
    slots = [int(tables[b, (c - 1) // page]) * page + (c - 1) % page if c else -1 for b, c in enumerate(contexts)]
    slot_mapping = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    norms = {}
    if norm_style:
        weights = (torch.randn(2, head_dim, generator=g) * 0.5 + (norm_style == "llama")).to(dtype).to(DEVICE)
        norms = dict(q_norm=weights[0], k_norm=weights[1], norm_eps=1e-6, norm_style=norm_style)
    meta = (tables.to(DEVICE), torch.arange(len(contexts), dtype=torch.int32, device=DEVICE),
            torch.tensor(contexts, dtype=torch.int32, device=DEVICE), page, head_dim**-0.5)
    same = lambda a, b: torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # noqa: E731  (e4m3 too)
    for splits in sorted({1, 4, num_splits(len(contexts), kv_heads, 132 if GPU else 2)}):
        options = dict(splits=splits, window=window, kv_scale=kv_scale)
        caches = (k_cache.clone(), v_cache.clone())
        q = rope_and_store(qkv, positions, table, slot_mapping, *caches, heads, kv_heads, kv_scale=kv_scale, **norms)
        want = decode_attention(q, *caches, *meta, **options)
        fused = (k_cache.clone(), v_cache.clone())
        new = NewTokens(qkv, positions, table, slot_mapping, heads, **norms)
        got = decode_attention(new, *fused, *meta, **options)
        assert not same(caches[0], k_cache)  # (the new keys were stored)
        if GPU and norm_style:
            # A head's norm sums its squares in another order in each kernel's layout on a GPU: float32 keeps the last
            # bit of the difference, and a narrower dtype rounds it away except where it crosses a rounding boundary.
            close = 1e-6 if dtype == torch.float32 else tolerance(dtype) / 8
            assert relative_error(fused[0].float(), caches[0].float()) < close and same(fused[1], caches[1]), splits
            assert relative_error(got, want) < close, splits
        else:
            assert same(fused[0], caches[0]) and same(fused[1], caches[1]), splits
            assert torch.equal(got, want), splits
