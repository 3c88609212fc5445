"""Quantized cores (engine/model/quant.py, ignition/quantize.py): GGUF blocks read exactly, both CPU kernels'
products (Flare's AVX2 one, engine/kernels/cpu/quant.cpp, and PyTorch's int4 one) against exact ones, and the default
quantized core against the same core dequantized to fp32."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import dequantize as gguf_dequantize
from gguf import quantize as gguf_quantize

from engine.executor.eager import kv_cache_shape
from engine.kernels.cpu import extension
from engine.model import quant
from engine.model.attention import AttentionMetadata, PrefillSpan
from engine.model.loader import load_model
from engine.model.quant import QuantLinear, codes_of, dequantize, pack
from ignition.quantize import Blocks, gguf_blocks, quantize

# PyTorch's kernel rounds inputs, scales and zeros to bfloat16 (8 significant bits) and accumulates in fp32, so a
# product of K terms differs from fp32's by about 2**-9 of the sum of |x| |w|: relative to that sum, allow 2**-7.
PRODUCT_TOLERANCE = 2**-7
# Logits of the quantized core against its fp32 dequantization, teacher-forced along the fp32 greedy path, the
# largest difference among SmolLM2's 49152 logits at any of 24 positions on these prompts (measured): PyTorch's
# kernel, which rounds every linear's input to bfloat16, 0.44 to 0.60; Flare's, which rounds the inputs of 4-bit
# products to int8 steps of their group of 32 (as llama.cpp's Q4 x Q8_1 products do; 8-bit ones to int16), 1.51 to
# 1.54, with greedy tokens equal on two prompts and a near tie flipped on the haiku's (fp32 top two 0.14 apart;
# with int16 inputs for 4-bit products too, as before 2026-12-02: 0.01, at half the speed without AVX-512 VNNI;
# docs/cpu.md, "Accuracy").
LOGIT_TOLERANCE = 2.0
NEW_TOKENS = 24


def product_error(layer: QuantLinear, weight: torch.Tensor, x: torch.Tensor) -> float:
    exact = x.double() @ weight.double().T
    scale = x.abs().double() @ weight.abs().double().T
    return float(((layer(x).double() - exact).abs() / scale).max())


@pytest.fixture(params=["flare", "torch"])
def kernel(request, monkeypatch) -> str:
    """Runs a test with each kernel QuantLinear may pick: Flare's (skipped where it cannot run) and PyTorch's."""
    if request.param == "flare" and extension.quant_mm() is None:
        pytest.skip("Flare's AVX2 kernel does not run here")
    if request.param == "torch":
        monkeypatch.setattr(quant.extension, "quant_mm", lambda: None)
    return request.param


def flare_bound(x: torch.Tensor, weight: torch.Tensor, bits: int) -> torch.Tensor:
    """How far Flare's kernel may be from x @ weight.T: each input is rounded to an integer step of its group of 32,
    (largest |x|) / 127 for 4-bit codes (int8 inputs, as llama.cpp's Q8_1 for its Q4 blocks) or / 32767 for 8-bit
    ones (int16), so by at most half a step (about 2^-8 or 2^-16 of the group's largest |x|), and fp32 sums of K
    terms and the step's own rounding add a few units of 2^-24 of the sum of |x| |w| (2^-20 allows K up to 16 * 32
    groups' worth of them)."""
    largest = x.abs().view(x.shape[0], -1, 32).amax(-1).repeat_interleave(32, dim=1).double()
    half_step = 1 / (2 * (127 if bits == 4 else 32767))
    return half_step * largest @ weight.abs().double().T + 2**-20 * x.abs().double() @ weight.abs().double().T


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows, inputs, outputs", [(1, 96, 7), (3, 160, 33), (16, 544, 65), (300, 288, 31)])
def test_flare_kernel_equals_the_exact_product(bits: int, rows: int, inputs: int, outputs: int) -> None:
    """quant_mm at every row count (decode, verify, prefill sizes; K not a multiple of 256, N odd), directly and
    through QuantLinear, against float64 products of the same weights."""
    if extension.quant_mm() is None:
        pytest.skip("Flare's AVX2 kernel does not run here")
    torch.manual_seed(rows + inputs)
    codes = torch.randint(0, 2**bits, (outputs, inputs), dtype=torch.int32)
    scale, minimum = torch.rand(outputs, inputs // 32) / 8, -torch.rand(outputs, inputs // 32)
    weight = dequantize(codes, scale, minimum)
    x = torch.randn(rows, inputs) * torch.rand(rows, 1) * 10
    exact = x.double() @ weight.double().T
    direct = torch.ops.flare_cpu.quant_mm(x, *pack(codes, scale, minimum, bits), bits)[:, :outputs].double()
    assert ((direct - exact).abs() <= flare_bound(x, weight, bits)).all()
    layer = QuantLinear(codes, bits, scale, minimum)
    assert layer.bits == bits
    assert ((layer(x).double() - exact).abs() <= flare_bound(x, weight, bits)).all()


@pytest.mark.parametrize("bits", [4, 8])
def test_fp16_scales_give_the_bits_of_fp32_ones(bits: int) -> None:
    """GGUF's fp16 scales and mins stay fp16 in QuantLinear (fewer bytes a step); they convert exactly, so the
    product is the same bits as with their fp32 values."""
    if extension.quant_mm() is None:
        pytest.skip("Flare's AVX2 kernel does not run here")
    torch.manual_seed(bits)
    codes = torch.randint(0, 2**bits, (37, 160), dtype=torch.int32)
    scale, minimum = (torch.rand(37, 5) / 8).half(), (-torch.rand(37, 5)).half()
    layer = QuantLinear(codes, bits, scale.float(), minimum.float())
    assert layer.scales.dtype == layer.mins.dtype == torch.float16
    x = torch.randn(6, 160)
    wide = torch.ops.flare_cpu.quant_mm(x, *pack(codes, scale.float(), minimum.float(), bits), bits)
    assert torch.equal(layer(x), wide[:, :37])
    assert QuantLinear(codes, bits, scale.float() / 3, minimum.float()).scales.dtype == torch.float32


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("inputs, outputs", [(288, 31), (576, 1536), (96, 40)])
def test_a_rows_product_does_not_depend_on_the_rows_beside_it(bits: int, inputs: int, outputs: int) -> None:
    """Each of 40 rows alone and among the 40 gets the same bits, so a prompt's last position scores alike whether
    its prefix was cached or not (an fp32 GEMM route for many rows differed by about 1e-7 of |x| @ |w|, which the
    input rounding turned into 1e-3 in logprobs: tests/e2e/test_api_openai.py's streamed and unstreamed logprobs). The
    kernel takes one row with 4 blocks of 8 outputs at a time and more rows with one block, with tails of either
    (40 outputs: 5 blocks), so every row here runs other code alone than among the others."""
    if extension.quant_mm() is None:
        pytest.skip("Flare's AVX2 kernel does not run here")
    torch.manual_seed(bits + inputs)
    codes = torch.randint(0, 2**bits, (outputs, inputs), dtype=torch.int32)
    scale, minimum = torch.rand(outputs, inputs // 32) / 8, -torch.rand(outputs, inputs // 32)
    layer = QuantLinear(codes, bits, scale, minimum)
    x = torch.randn(40, inputs) * torch.rand(40, 1) * 10
    assert torch.equal(torch.cat([layer(row) for row in x.split(1)]), layer(x))
    assert torch.equal(torch.cat([layer(rows) for rows in x.split(3)]), layer(x))


def test_avx512_vnni_copy_gives_the_bits_of_the_avx2_one(tmp_path: Path) -> None:
    """Where the CPU has AVX-512 VNNI, quant_mm runs engine/kernels/cpu/quant_vnni.cpp's copy of the kernel;
    FLARE_QUANT_ISA=avx2 (read once per process, so a second process here) runs the AVX2 one, as on an AVX2-only
    machine. Integer sums are exact and the fp32 chain is the same, so every row count and width gives the same
    bits."""
    if extension.quant_mm() is None or "avx512_vnni" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("no AVX-512 VNNI copy runs here")
    torch.manual_seed(11)
    cases = []
    for bits, rows, inputs, outputs in ((4, 1, 576, 200), (4, 17, 544, 72), (8, 13, 160, 40), (8, 2, 96, 24)):
        codes = torch.randint(0, 2**bits, (outputs, inputs), dtype=torch.int32)
        scale, minimum = (torch.rand(outputs, inputs // 32) / 8).half(), (-torch.rand(outputs, inputs // 32)).half()
        cases.append((torch.randn(rows, inputs) * 3, *pack(codes, scale, minimum, bits), bits))
    torch.save(cases, tmp_path / "cases.pt")
    script = ("import sys, torch; from engine.kernels.cpu import extension; extension.quant_mm(); "
              "cases = torch.load(sys.argv[1]); "
              "torch.save([torch.ops.flare_cpu.quant_mm(*case) for case in cases], sys.argv[2])")
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "cases.pt"), str(tmp_path / "avx2.pt")],
                   env={**os.environ, "FLARE_QUANT_ISA": "avx2"}, cwd=Path(__file__).parents[2], check=True)
    for case, avx2 in zip(cases, torch.load(tmp_path / "avx2.pt")):
        assert torch.equal(torch.ops.flare_cpu.quant_mm(*case), avx2)


def test_fused_layers_equal_their_parts(kernel: str) -> None:
    """Fused q/k/v and gate/up layers (QuantLinear.concat); PyTorch's kernel packs rows in blocks, so it fuses only
    parts of whole blocks (48 rows beside others once gave wrong outputs)."""
    torch.manual_seed(3)

    def layers(*sizes: int) -> list[QuantLinear]:
        return [QuantLinear(b.codes.to(torch.int32), 4, b.scale, b.minimum)
                for b in (quantize(torch.randn(n, 64), 4) for n in sizes)]

    parts = layers(48, 16, 32)
    if kernel == "torch":
        assert QuantLinear.concat(*parts) is None
        parts = layers(64, 128, 64)
    fused = QuantLinear.concat(*parts)
    x = torch.randn(5, 64)
    apart = torch.cat([layer(x) for layer in parts], dim=1)
    if kernel == "flare":  # a column's sums do not depend on its neighbours
        assert torch.equal(fused(x), apart)
    else:  # PyTorch's kernel blocks its sums by the layer's width
        torch.testing.assert_close(fused(x), apart, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_are_read_exactly(kind: str) -> None:
    weight = np.random.default_rng(0).normal(size=(48, 96)).astype(np.float32)
    qtype = GGMLQuantizationType[kind]
    raw = gguf_quantize(weight, qtype)
    blocks = gguf_blocks(raw, kind, weight.shape)
    assert torch.equal(blocks.dequantize(), torch.from_numpy(gguf_dequantize(raw, qtype)))


@pytest.mark.parametrize("bits", [4, 8])
def test_core_tensors_round_trip_and_the_kernel_agrees_with_fp32(bits: int, kernel: str) -> None:
    torch.manual_seed(bits)
    weight = torch.randn(84, 160)  # rows not a multiple of the kernel's 16: padded
    blocks = quantize(weight, bits)
    tensors = blocks.core_tensors("w")
    codes, read_bits = codes_of(tensors, "w")
    assert read_bits == bits and torch.equal(codes, blocks.codes.to(torch.int32))
    dense = dequantize(codes, tensors["w.scale"], tensors["w.min"])
    assert torch.equal(dense, blocks.dequantize())
    assert (dense - weight).abs().max() <= blocks.scale.max() / 2 + 1e-6  # round to nearest
    layer = QuantLinear(codes, bits, tensors["w.scale"], tensors["w.min"])
    for rows in (1, 5, 64):
        assert product_error(layer, dense, torch.randn(rows, 160)) < PRODUCT_TOLERANCE
    assert layer(torch.randn(2, 3, 160)).shape == (2, 3, 84)


def test_four_bit_blocks_are_exact_as_eight_bit_ones() -> None:
    blocks = quantize(torch.randn(16, 64), 4)
    wide = blocks.with_bits(8)
    assert wide.bits == 8 and torch.equal(wide.dequantize(), blocks.dequantize())
    assert Blocks(wide.codes, wide.scale, wide.minimum, 8).with_bits(4).bits == 4


def greedy(model, prompt: list[int], count: int, forced: list[int] | None = None
           ) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the logits of each step, one sequence on pages 0..; with `forced`, the model is fed
    those tokens instead of its own (teacher forcing), so two models' logits compare position by position."""
    page = 64
    pages = (len(prompt) + count) // page + 1
    kv = torch.zeros(kv_cache_shape(model, pages, page))
    table = torch.arange(pages)
    tokens, logits = [], []
    ids, start = torch.tensor(prompt), 0
    with torch.inference_mode():
        for step in range(count):
            end = start + ids.numel()
            slots = torch.arange(start, end)
            if ids.numel() > 1:
                meta = AttentionMetadata(slots, torch.empty(0, dtype=torch.int64), table[None, :0],
                                         torch.empty(0, dtype=torch.int64), (PrefillSpan(0, end, end, table),), page)
            else:
                meta = AttentionMetadata(slots, torch.tensor([0]), table[None], torch.tensor([end]), (), page)
            row = model.logits(model(ids, slots, kv, meta)[-1:])[0]
            logits.append(row)
            tokens.append(int(row.argmax()))
            ids, start = torch.tensor([forced[step] if forced else tokens[-1]]), end
    return tokens, logits


@pytest.fixture(scope="module")
def quantized_and_dequantized(core_dir: Path):
    from common.manifest import load_manifest

    if not load_manifest(core_dir).quantization:
        pytest.skip(f"{core_dir} is not a quantized core")
    return (load_model(core_dir, torch.device("cpu"))[1],
            load_model(core_dir, torch.device("cpu"), dequantized=True)[1])


def parity_prompts(core_dir: Path) -> list[list[int]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(core_dir / "tokenizer.json"))
    texts = ["<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
             "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
             "<|im_start|>user\nCount from one to ten in words, separated by commas.<|im_end|>\n"
             "<|im_start|>assistant\n"]
    return [tokenizer.encode(text, add_special_tokens=False).ids for text in texts]


def test_quantized_core_equals_its_fp32_dequantization(core_dir: Path, quantized_and_dequantized) -> None:
    """Both accuracy checks of a quantized core: teacher-forced logits agree within LOGIT_TOLERANCE everywhere, and
    greedy tokens are equal, or first differ only where the fp32 top two are within that tolerance (a near tie that the
    kernel's rounding may flip)."""
    quantized, dense = quantized_and_dequantized
    for prompt in parity_prompts(core_dir):
        want, dense_logits = greedy(dense, prompt, NEW_TOKENS)
        _, forced_logits = greedy(quantized, prompt, NEW_TOKENS, forced=want)
        worst = max(float((a - b).abs().max()) for a, b in zip(forced_logits, dense_logits))
        assert worst < LOGIT_TOLERANCE, (prompt, worst)
        got, _ = greedy(quantized, prompt, NEW_TOKENS)
        if got != want:
            first = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            top = dense_logits[first].topk(2).values
            assert float(top[0] - top[1]) < LOGIT_TOLERANCE, (prompt, first, got, want)


def step_logits(model, steps: list[list[tuple[int, list[int]]]], pages: int = 8, page: int = 16
                ) -> dict[int, list[torch.Tensor]]:
    """Logits of every token fed, per sequence: `steps` lists each step's (sequence, its next tokens) pairs, a pair
    of one token a decode row, of more a prefill span after what the sequence was fed before (sequence s on pages
    s * pages ..)."""
    kv = torch.zeros(kv_cache_shape(model, 2 * pages, page))
    fed: dict[int, int] = {}
    out: dict[int, list[torch.Tensor]] = {}
    with torch.inference_mode():
        for step in steps:
            ids, slots, spans, decode_rows, decode_tables, decode_lens = [], [], [], [], [], []
            for seq, tokens in step:
                start, table = fed.get(seq, 0), torch.arange(seq * pages, (seq + 1) * pages)
                end = start + len(tokens)
                if len(tokens) > 1:
                    spans.append(PrefillSpan(len(ids), len(tokens), end, table))
                else:
                    decode_rows.append(len(ids))
                    decode_tables.append(table)
                    decode_lens.append(end)
                ids += tokens
                slots += [int(table[p // page]) * page + p % page for p in range(start, end)]
                fed[seq] = end
            meta = AttentionMetadata(torch.tensor(slots), torch.tensor(decode_rows, dtype=torch.int64),
                                     torch.stack(decode_tables) if decode_tables else torch.zeros(0, pages,
                                                                                                  dtype=torch.int64),
                                     torch.tensor(decode_lens, dtype=torch.int64), tuple(spans), page)
            logits = model.logits(model(torch.tensor(ids), torch.tensor(slots), kv, meta))
            row = 0
            for seq, tokens in step:
                out.setdefault(seq, []).extend(logits[row:row + len(tokens)])
                row += len(tokens)
    return out


def test_a_tokens_logits_are_the_same_bits_in_whatever_step_it_came(core_dir: Path, quantized_and_dequantized
                                                                    ) -> None:
    """A quantized core rounds each product's inputs to integers, which turns a last-place difference into other
    tokens at a near tie: so a token's logits must be the same bits whether its sequence came whole, after a cached
    prefix, in verify-sized chunks or token by token, alone or beside another request's prompt and decode rows
    (the same greedy request served twice once ended differently as speculation grouped its tokens otherwise)."""
    quantized, _ = quantized_and_dequantized
    first, second = parity_prompts(core_dir)[:2]
    prompt = len(first)
    chunks = [prompt - 7, 4, 1, 2, 5, 1, 3, 1, 6, 2, 1, 2, 1]  # a cached prefix, then what verify rounds take
    tokens = first + greedy(quantized, first, sum(chunks) - prompt)[0]
    one_by_one = step_logits(quantized, [[(0, tokens[:prompt])]] + [[(0, [t])] for t in tokens[prompt:]])[0]
    bounds = np.cumsum([0] + chunks)
    grouped = step_logits(quantized, [[(0, tokens[a:b])] for a, b in zip(bounds, bounds[1:])])[0]
    whole = step_logits(quantized, [[(0, tokens)]])[0]
    # Beside another request: its prompt, then its decode rows, in the steps of this one's chunks.
    other = second + greedy(quantized, second, len(chunks) - 1)[0]
    mixed_steps = [[(1, other[:len(second)]), (0, tokens[bounds[0]:bounds[1]])]] + \
        [[(0, tokens[a:b]), (1, [other[len(second) + i]])] for i, (a, b) in enumerate(zip(bounds[1:], bounds[2:]))]
    mixed = step_logits(quantized, mixed_steps)
    alone = step_logits(quantized, [[(1, other[:len(second)])]] + [[(1, [t])] for t in other[len(second):]])[1]
    for name, logits in (("chunks", grouped), ("whole", whole), ("beside another", mixed[0])):
        different = [i for i, (a, b) in enumerate(zip(logits, one_by_one)) if not torch.equal(a, b)]
        assert not different, (name, different)
    assert all(torch.equal(a, b) for a, b in zip(mixed[1], alone))
