"""Weight-only quantized linears on the CPU: a core's 4- and 8-bit groups run by Flare's AVX2 kernel or PyTorch's.

docs/design.md, Models and kernels. A quantized core (ignition/quantize.py writes it) holds, for a weight `P.weight` of
shape [N, K], codes `P.weight.q4` (uint8 [N, K/2], two codes a byte, low nibble first) or `P.weight.q8` (uint8
[N, K]), and per group of 32 inputs `P.weight.scale` and `P.weight.min` ([N, K/32]), with

    w[n, k] = scale[n, k // 32] * code[n, k] + min[n, k // 32]

which is exactly GGUF's Q4_0, Q4_1 and Q8_0 blocks (and any block format of up to 8 bits with one scale and
minimum per 32 weights).

Two kernels run them. Where the CPU has AVX2/FMA, Flare's own (engine/kernels/cpu/quant.cpp, built by engine/kernels/cpu/extension.py): the codes
are repacked once at load time (`pack`) and every product reads them as they are, with the fp32 input rounded
per group of 32 to int8 for 4-bit codes (at most 2^-8 of the group's largest |x|, llama.cpp's Q8_1 rounding) and
to int16 for 8-bit ones (2^-16). It runs prefill chunks too, although
dequantizing to fp32 for PyTorch's GEMM is faster from 32 rows on (15 against 22 ms at 512 x 576 -> 1536, two
threads): a row's product must not depend on the rows beside it, or a prompt's last position would score
differently with its prefix cached than without (the input rounding turns the GEMM's other summation order into
differences of 1e-3 in logprobs). docs/cpu.md, "On an AVX2-only machine", has the measurements.

Otherwise PyTorch's `torch.ops.aten._weight_int4pack_mm_for_cpu`, which computes x @ w.T for
w = (code - 8) * scale + zero in groups of 32, so a 4-bit group maps onto it with zero = min + 8 * scale. An 8-bit
code is 16 * hi + lo with two 4-bit halves, so an 8-bit weight is two 4-bit ones side by side ([hi | lo], K
doubled) against the input repeated twice: hi with scale 16 * scale and zero 128 * scale + min, lo with scale
`scale` and zero 8 * scale. That kernel is fast only with bfloat16 inputs (its fp32 path is scalar), so a
quantized linear rounds its input, scales and zeros to bfloat16 and accumulates in fp32; its output returns to the
model's dtype.

`quantize_linears` is the hook the loader calls: it swaps every nn.Linear whose weight the core holds quantized
(any family, any name) for a QuantLinear, and gives every nn.Embedding its dense rows back (a lookup reads only
the step's rows, so dense costs memory, not time).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.kernels.cpu import extension

GROUP = 32
COLUMNS = 8  # Flare's kernel takes outputs in blocks of 8
SUFFIXES = (".q4", ".q8", ".scale", ".min")
_int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu
# Rows a part of a fused layer must come in for PyTorch's kernel (see QuantLinear.concat).
TORCH_ROW_BLOCK = 64


def codes_of(state: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, int] | None:
    """The codes of weight `name` as int32 [N, K] and their bit width, or None if the core holds it dense."""
    if (packed := state.get(f"{name}.q4")) is not None:
        codes = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)
        return codes.to(torch.int32), 4
    if (codes := state.get(f"{name}.q8")) is not None:
        return codes.to(torch.int32), 8
    return None


def dequantize(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The fp32 weight of codes [N, K] with per-group scale and minimum [N, K/32]."""
    scale = scale.float().repeat_interleave(GROUP, dim=1)
    return codes.float() * scale + minimum.float().repeat_interleave(GROUP, dim=1)


def pack(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes [N, K] and their scales and mins [N, K/32] as Flare's kernel reads them (engine/kernels/cpu/quant.cpp, "Layouts"):
    outputs padded to a multiple of 8 with zero weights (cut from the product by QuantLinear) and taken in blocks
    of 8; per block and group, 32-byte chunks of 16-bit words, word i holding the codes of column i // 2 at inputs
    2p + i % 2 of the chunk's pairs p (16 // bits of them, from the low bits up); scales and mins per block as
    [group, column]."""
    n, k = codes.shape
    pad = -n % COLUMNS
    codes, scale, minimum = (nn.functional.pad(t, (0, 0, 0, pad)) for t in (codes.to(torch.int32), scale, minimum))
    blocks, groups, pairs = (n + pad) // COLUMNS, k // GROUP, 16 // bits
    # [block, column, group, chunk, pair, input of the pair] -> [block, group, chunk, column, input, pair]
    words = codes.view(blocks, COLUMNS, groups, GROUP // 2 // pairs, pairs, 2).permute(0, 2, 3, 1, 5, 4)
    words = (words << (torch.arange(pairs, dtype=torch.int32) * bits)).sum(-1)
    # Little-endian bytes of each 16-bit word.
    packed = torch.stack([words & 255, words >> 8], dim=-1).to(torch.uint8)
    per_block = [t.reshape(blocks, COLUMNS, groups).transpose(1, 2).reshape(n + pad, groups).contiguous()
                 for t in (scale, minimum)]
    return packed.reshape(n + pad, k * bits // 8).contiguous(), per_block[0], per_block[1]


def narrowest(scale: torch.Tensor, minimum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 scales and mins as fp16 where both convert exactly (GGUF's blocks), else as they are: Flare's kernel
    takes either with the same results, and a decode step at one stream is bound by the bytes it reads."""
    half = scale.half(), minimum.half()
    if all(torch.equal(h.float(), v) for h, v in zip(half, (scale, minimum))):
        return half
    return scale, minimum


class QuantLinear(nn.Module):
    """y = x @ w.T (+ bias) with w held as 4- or 8-bit groups: packed for Flare's AVX2 kernel where it runs
    (`bits` set), else as int4 groups for PyTorch's kernel (two sets for an 8-bit w; `bits` None)."""

    def __init__(self, codes: torch.Tensor, bits: int, scale: torch.Tensor, minimum: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        if self.in_features % GROUP:
            raise ValueError(f"a quantized weight needs a multiple of {GROUP} inputs, not {self.in_features}")
        scale, minimum = scale.float(), minimum.float()
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        if bits not in (4, 8):
            raise ValueError(f"{bits}-bit codes are not supported (4 or 8)")
        self.bits = bits if extension.quant_mm() is not None else None
        if self.bits is not None:
            for name, tensor in zip(("codes", "scales", "mins"), pack(codes, *narrowest(scale, minimum), bits)):
                self.register_buffer(name, tensor, persistent=False)
            return
        if bits == 4:
            halves = [(codes, scale, minimum + 8 * scale)]
        else:
            halves = [(codes >> 4, 16 * scale, 128 * scale + minimum), (codes & 15, scale, 8 * scale)]
        self.repeats = len(halves)
        # The kernel packs rows in sixteens: pad with zero weights, cut from the output.
        pad = -self.out_features % 16
        halves = [tuple(nn.functional.pad(t, (0, 0, 0, pad)) for t in half) for half in halves]
        codes4 = torch.cat([c for c, _, _ in halves], dim=1).contiguous()
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes4, 1), persistent=False)
        # The kernel's layout: [groups, N, (scale, zero)].
        scales_and_zeros = torch.stack([torch.cat([s for _, s, _ in halves], dim=1),
                                        torch.cat([z for _, _, z in halves], dim=1)], dim=-1)
        self.register_buffer("scales_and_zeros", scales_and_zeros.transpose(0, 1).contiguous().bfloat16(),
                             persistent=False)

    @classmethod
    def concat(cls, *parts: QuantLinear) -> QuantLinear | None:
        """One layer computing the parts' outputs side by side (fused q/k/v and gate/up: one kernel call instead of
        several), or None where they cannot share one call: other inputs, other code widths, or a part whose rows
        are not a whole number of the kernel's blocks. Both layouts are blocks of outputs, so packed rows
        concatenate as they are by whole blocks: Flare's 8 rows (padding would sit between the parts), PyTorch's
        32 on an AVX2 machine (a part of 48 rows beside others gave wrong outputs; 64 covers the block sizes of its
        other CPU paths too)."""
        first = parts[0]
        if any(p.in_features != first.in_features or p.bits != first.bits for p in parts) or \
                len({p.bias is None for p in parts}) > 1:
            return None
        names = ("codes", "scales", "mins") if first.bits is not None else ("packed", "scales_and_zeros")
        if first.bits is not None and any(p.out_features % COLUMNS for p in parts):
            return None
        if first.bits is None and any(p.repeats != first.repeats or p.out_features % TORCH_ROW_BLOCK
                                      for p in parts):
            return None
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.in_features, fused.out_features = first.in_features, sum(p.out_features for p in parts)
        fused.bits = first.bits
        if first.bits is None:
            fused.repeats = first.repeats
        for name in names:
            # The kernel's scales_and_zeros are [groups, N, 2]: outputs on dim 1.
            dim = 1 if name == "scales_and_zeros" else 0
            fused.register_buffer(name, torch.cat([getattr(p, name) for p in parts], dim=dim), persistent=False)
        fused.bias = None if first.bias is None else nn.Parameter(torch.cat([p.bias for p in parts]),
                                                                  requires_grad=False)
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Few operators on purpose: a decode step calls this seven times a layer.
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if self.bits is not None:
            if rows.dtype != torch.float32 or not rows.is_contiguous():  # a conversion is an operator call
                rows = rows.float().contiguous()
            out = torch.ops.flare_cpu.quant_mm(rows, self.codes, self.scales, self.mins, self.bits)
            if out.shape[-1] != self.out_features:  # padded to whole blocks
                out = out[:, :self.out_features]
            if x.dtype != torch.float32:
                out = out.to(x.dtype)
        else:
            rows = rows.to(torch.bfloat16)
            if self.repeats > 1:
                rows = rows.repeat(1, self.repeats)
            out = _int4_mm(rows, self.packed, GROUP, self.scales_and_zeros).to(x.dtype)
            if out.shape[-1] != self.out_features:
                out = out[:, :self.out_features]
        if self.bias is not None:
            out = out + self.bias
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)


def is_quantized(state: dict[str, torch.Tensor]) -> bool:
    return any(name.endswith((".q4", ".q8")) for name in state)


def quantize_linears(model: nn.Module, state: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Replace the linears whose weights `state` holds quantized by QuantLinears and put the dense weight of every
    quantized embedding into `state`; the quantized entries leave `state`, so what is left loads as usual."""
    for path, module in list(model.named_modules()):
        weight = f"{path}.weight"
        found = codes_of(state, weight)
        if found is None:
            continue
        codes, bits = found
        scale, minimum = state[f"{weight}.scale"], state[f"{weight}.min"]
        if isinstance(module, nn.Embedding):
            state[weight] = dequantize(codes, scale, minimum).to(dtype)
        elif isinstance(module, nn.Linear):
            bias = state.pop(f"{path}.bias", None)
            parent, _, leaf = path.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf,
                    QuantLinear(codes, bits, scale, minimum, None if bias is None else bias.to(dtype)))
        else:
            raise TypeError(f"{path}: a quantized weight for a {type(module).__name__}")
    for name in [n for n in state if n.endswith(SUFFIXES)]:
        del state[name]


def quantized_view(weight: str, state: dict[str, torch.Tensor]) -> QuantLinear | None:
    """A QuantLinear over weight `weight` of `state` (an embedding's, for a tied output layer), if quantized."""
    found = codes_of(state, weight)
    if found is None:
        return None
    return QuantLinear(found[0], found[1], state[f"{weight}.scale"], state[f"{weight}.min"])


def dequantize_all(state: dict[str, torch.Tensor]) -> None:
    """Replace every quantized weight of `state` by its fp32 values (for a GPU, or as the fp32 reference)."""
    for name in [n.removesuffix(".scale") for n in state if n.endswith(".scale")]:
        codes, _ = codes_of(state, name)
        state[name] = dequantize(codes, state[f"{name}.scale"], state[f"{name}.min"])
    for name in [n for n in state if n.endswith(SUFFIXES)]:
        del state[name]


def output_layer(quantized: QuantLinear, rows: Callable[[], torch.Tensor]) -> nn.Module:
    """A quantized core's output layer, given its QuantLinear and its dense rows (`rows()`, the tied embedding's
    weight or the head dequantized). Flare's kernel runs as it is: its fp32 logits differ from the dense product's by
    the rounding of its inputs alone (8-bit codes, as SmolLM2's: int16, 2^-16 of a group's largest |x|, under 1e-3
    in SmolLM2's logits; 4-bit codes: int8, 2^-8), and
    refining them cost 15-20% of the layer (0.3 ms of CPU a row at one stream, 3 ms for sixteen: a top-k over the
    vocabulary, a gather of 64 dense rows and their products).
    PyTorch's kernel returns bfloat16-rounded logits, which RefinedLogits refines."""
    return quantized if quantized.bits is not None else RefinedLogits(quantized, rows())


class RefinedLogits(nn.Module):
    """The output layer of a quantized core. PyTorch's int4 kernel returns bfloat16, whose steps near SmolLM2's top
    logits (16 to 32) are 0.125 wide, so the leading candidates would often tie; so the REFINED largest logits of
    each row are recomputed in fp32 from the dense rows (the embedding's when tied), the rest keep the kernel's
    values (output_layer: only PyTorch's kernel needs it)."""

    REFINED = 64

    def __init__(self, quantized: QuantLinear, rows: torch.Tensor) -> None:
        super().__init__()
        self.quantized = quantized
        self.rows = [rows]  # a list: the tied embedding's weight, not registered twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.quantized(x)
        top = logits.topk(min(self.REFINED, logits.shape[-1]), dim=-1).indices  # [T, R]
        exact = torch.bmm(self.rows[0][top], x.to(self.rows[0].dtype).unsqueeze(-1)).squeeze(-1)
        return logits.scatter(-1, top, exact.to(logits.dtype))
