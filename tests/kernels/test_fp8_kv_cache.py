"""The kernels over an FP8 KV cache (engine/model/kv_quant.py) against torch references that quantize K and V the
same way: the stores write the e4m3 bytes torch's cast writes, and the attention kernels read value * scale within
the tolerance their dtype has over any cache. On a GPU these are GPU tests; on the CPU they run under the
interpreter at small sizes, one shape each."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.kernels.triton.decode_attention import decode_attention, decode_attention_reference  # noqa: E402
from engine.kernels.triton.extend_attention import extend_attention, extend_attention_reference  # noqa: E402
from engine.kernels.triton import kv_store  # noqa: E402
from engine.kernels.triton.kv_store import store_kv, store_kv_reference  # noqa: E402
from engine.kernels.triton.rotary import rope_and_store, rope_and_store_reference, rope_table  # noqa: E402
from engine.model.kv_quant import FP8, quantize  # noqa: E402
from tests.kernels.test_triton_kernels import (DEVICE, DTYPES, GPU, SHAPES, extend_case, random_pages,  # noqa: E402
                                               relative_error, tolerance)

pytestmark = [pytest.mark.gpu] if GPU else []


def bytes_of(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8)


def head_scales(kv_heads: int, g: torch.Generator) -> torch.Tensor:
    """[2, KVH] scales, keys' then values', none of them 1."""
    return (torch.rand(2, kv_heads, generator=g) * 1.5 + 0.25).to(DEVICE)


def fp8_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Random caches (values a few times their scale, so that the e4m3 grid shows) quantized to e4m3."""
    return quantize(k_cache.float() * 4, scale[0]), quantize(v_cache.float() * 4, scale[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_writes_the_bytes_torchs_cast_writes(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(11)
    tokens, kv_heads, head_dim, slots = 37, 3, 16, 64
    spread = torch.tensor([1.0, 30.0, 1000.0])[:, None]  # the last head's values saturate at +-448 * scale
    k = (torch.randn(tokens, kv_heads, head_dim, generator=g) * spread).to(dtype)
    v = (torch.randn(tokens, kv_heads, head_dim, generator=g) * 0.01).to(dtype)  # e4m3's subnormals
    k[0, 0, :4] = torch.tensor([0.0, -0.0, 1e-5, -1e-5])  # signed zeros, and values that round to them
    scale = head_scales(kv_heads, g)
    slot_mapping = torch.randperm(slots, generator=g)[:tokens].to(torch.int32)
    slot_mapping[::6] = -1  # graph padding writes nothing
    cache = torch.zeros(2, 2, slots, kv_heads, head_dim, dtype=FP8, device=DEVICE)
    store_kv(k.to(DEVICE), v.to(DEVICE), slot_mapping.to(DEVICE), cache[0, 0], cache[0, 1], scale)
    store_kv_reference(k.to(DEVICE), v.to(DEVICE), slot_mapping.to(DEVICE), cache[1, 0], cache[1, 1], scale)
    assert torch.equal(bytes_of(cache[0]), bytes_of(cache[1]))
    assert bytes_of(cache[1, 0]).any() and bytes_of(cache[1, 1]).any()
    assert bytes_of(cache[1, :, slot_mapping[0].long()]).eq(0).all()  # a padding token's slot stayed empty


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_style", [None, "llama"])
def test_rope_and_store_quantizes_the_rotated_key_and_the_value(dtype: torch.dtype, norm_style: str | None) -> None:
    """With Qwen3's head norms too: the normalised key rounds to the model's dtype, not to the cache's."""
    heads, kv_heads, head_dim = (32, 8, 128) if GPU else (4, 2, 32)
    g = torch.Generator().manual_seed(12)
    tokens, slots = 29, 64
    table = rope_table(1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)), 4096).to(DEVICE)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g) * 3).to(dtype).to(DEVICE)
    positions = torch.randint(0, 4096, (tokens,), generator=g).to(DEVICE)
    slot_mapping = torch.randperm(slots, generator=g)[:tokens].to(torch.int32).to(DEVICE)
    scale = head_scales(kv_heads, g)
    norms = {}
    if norm_style:
        weights = (torch.randn(2, head_dim, generator=g) * 0.5 + 1).to(dtype).to(DEVICE)
        norms = dict(q_norm=weights[0], k_norm=weights[1], norm_eps=1e-6, norm_style=norm_style)
    caches = torch.zeros(2, 2, slots, kv_heads, head_dim, dtype=FP8, device=DEVICE)
    q = rope_and_store(qkv, positions, table, slot_mapping, caches[0, 0], caches[0, 1], heads, kv_heads,
                       kv_scale=scale, **norms)
    q_ref = rope_and_store_reference(qkv, positions, table, slot_mapping, caches[1, 0], caches[1, 1], heads,
                                     kv_heads, kv_scale=scale, **norms)
    assert relative_error(q, q_ref) < tolerance(dtype) / 10
    assert torch.equal(bytes_of(caches[0, 1]), bytes_of(caches[1, 1]))  # values: quantized as they came
    # Keys: the kernel's rotation may round its last bit otherwise than torch's, which can move a key across an
    # e4m3 rounding boundary; the rest are the same bytes.
    differ = bytes_of(caches[0, 0]) != bytes_of(caches[1, 0])
    assert int(differ.sum()) <= caches[0, 0].numel() // 1000
    if not GPU:  # the interpreter rotates in numpy's float32, as torch does
        assert not differ.any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("to_float16", [False, True], ids=["widened-to-the-query-dtype", "widened-to-float16"])
def test_decode_attention_over_fp8_pages_matches_reference(dtype: torch.dtype, to_float16: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_store, "E4M3_TO_FLOAT16", to_float16)
    heads, kv_heads, head_dim, page = SHAPES[0]
    g = torch.Generator().manual_seed(13)
    contexts = [1, page + 3, 3 * page + 5, 0] if not GPU else [1, 63, 1000, 0, 4097, 32768]
    tables = random_pages(contexts, page, g)
    slots = (int(tables.max()) + 1) * page
    scale = head_scales(kv_heads, g)
    k_cache, v_cache = fp8_cache(*torch.randn(2, slots, kv_heads, head_dim, generator=g).to(DEVICE), scale)
    q = torch.randn(len(contexts), heads, head_dim, generator=g).to(dtype).to(DEVICE)
    args = (q, k_cache, v_cache, tables.to(DEVICE), torch.arange(len(contexts), dtype=torch.int32, device=DEVICE),
            torch.tensor(contexts, dtype=torch.int32, device=DEVICE), page, head_dim**-0.5)
    ref = decode_attention_reference(*args, kv_scale=scale)
    # The scales matter: the same bytes read as if they were 1 give another answer.
    assert relative_error(decode_attention_reference(*args, kv_scale=torch.ones_like(scale)), ref) > 0.05
    for splits in (1, 4):
        out = decode_attention(*args, splits=splits, kv_scale=scale)
        assert relative_error(out, ref) < tolerance(dtype), splits


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("to_float16", [False, True], ids=["widened-to-the-query-dtype", "widened-to-float16"])
def test_extend_attention_over_fp8_pages_matches_reference(dtype: torch.dtype, to_float16: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_store, "E4M3_TO_FLOAT16", to_float16)
    shape = SHAPES[0]
    page, head_dim = shape[3], shape[2]
    g = torch.Generator().manual_seed(14)
    # A fresh prompt, a chunk after a cached prefix, a decode row: full, short and narrow blocks.
    spans = [(70, page), (1, 2 * page + 3), (12, 5)] if not GPU else [(512, 0), (300, 1024), (1, 9000), (13, 4000)]
    q, k_cache, v_cache, meta, blocks = extend_case(shape, dtype, spans, g)
    scale = head_scales(shape[1], g)
    k_cache, v_cache = fp8_cache(k_cache, v_cache, scale)
    ref = extend_attention_reference(q, k_cache, v_cache, *meta, page, head_dim**-0.5, kv_scale=scale)
    new = sum(n for n, _ in spans)
    for programs in (None, 10**4) if GPU else (None, 112):  # the second splits long blocks' keys, then merges
        out = torch.zeros_like(q)
        extend_attention(q, k_cache, v_cache, out, *meta, *blocks, page, head_dim**-0.5, programs=programs,
                         kv_scale=scale)
        assert relative_error(out[:new], ref[:new]) < tolerance(dtype), programs
