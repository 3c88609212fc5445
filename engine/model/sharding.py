"""Which slice of each weight a tensor-parallel rank holds, and reading only that slice from the core.

Column-parallel (output rows split): q/k/v_proj by heads (an attention layer's KV scales, one per KV head, with
them), gate/up_proj by MLP columns. Row-parallel (input columns
split, partial sums all-reduced): o_proj by heads, down_proj by MLP columns. Vocabulary-parallel: embed_tokens and
lm_head by rows. Norms are replicated.

Heads are split by KV group, so that every query head sits on the rank of its KV head:
- R <= KV heads: each rank takes a contiguous run of whole KV groups. Runs are balanced and differ by at most one
  group, so SmolLM2's 3 groups (9 heads, 3 KV heads) go 2 + 1 over 2 ranks: correct, but rank 0 does twice the
  attention work of rank 1.
- R > KV heads: each KV head is replicated on R / KV ranks, which split its group's query heads; this needs R to be
  a multiple of the KV heads and to divide the query heads.
MLP columns and vocabulary rows split into balanced contiguous runs for any R.

Gated attention (Qwen3.5, Qwen3-Next) holds each head's q rows, then its gate rows, in q_proj: q_proj splits by heads
in units of twice the head dim. The Gated DeltaNet layers of those hybrids split by key heads, each with its group of
value heads (a rank holds num_key_heads / R key heads and num_value_heads / R value heads, so R must divide both):
in_proj_qkv and the conv's channels take the rank's q rows, k rows and v rows (in that order, as the layer reads
them), in_proj_z its value heads' rows, in_proj_b, in_proj_a, dt_bias and A_log its value heads, out_proj the same
columns (row-parallel, like o_proj); the gated norm, per value head with one weight, is replicated. Each rank's
recurrent state then holds only its value heads' rows. A shared expert splits by its own MLP columns.

Mixture-of-experts layers split every expert by its MLP columns, like the dense MLP: rank r holds rows of each
expert's w13 (its run of gate rows and the same run of up rows) and the matching columns of w2; the router is
replicated. Every rank then does the same share of the work whatever the routing picks, and the layer ends in the
dense MLP's one all-reduce. Splitting by expert instead would leave a rank idle, or the bottleneck, whenever the
routing is uneven (and at batch 1 most ranks would hold none of the k experts chosen).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from common.errors import CoreError
from engine.model import fp8

if TYPE_CHECKING:
    from engine.model.config import DecoderConfig, LinearAttention


def balanced(n: int, parts: int, index: int) -> range:
    """Part `index` of `parts` contiguous runs covering range(n), sizes differing by at most one."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (index < extra))


def supported_world_sizes(num_heads: int, num_kv_heads: int, linear: LinearAttention | None = None) -> list[int]:
    """`linear`: a hybrid's linear-attention shape, whose key and value heads each rank takes an equal share of."""
    return [r for r in range(1, num_heads + 1)
            if (r <= num_kv_heads or (r % num_kv_heads == 0 and num_heads % r == 0))
            and (linear is None or linear.num_key_heads % r == linear.num_value_heads % r == 0)]


# Weight name suffix -> (the dimension split, what it is split by). Names absent here are replicated.
SPLITS = {
    "q_proj.weight": (0, "query_rows"), "q_proj.bias": (0, "query_rows"),
    "k_proj.weight": (0, "kv_heads"), "k_proj.bias": (0, "kv_heads"),
    "v_proj.weight": (0, "kv_heads"), "v_proj.bias": (0, "kv_heads"),
    "o_proj.weight": (1, "heads"),
    "self_attn.k_scale": (0, "kv_head_scales"), "self_attn.v_scale": (0, "kv_head_scales"),  # an FP8 KV cache's
    # A shared expert's names end as the dense MLP's: its entries come first, as the first match is taken.
    "shared_expert.gate_proj.weight": (0, "shared_columns"), "shared_expert.up_proj.weight": (0, "shared_columns"),
    "shared_expert.down_proj.weight": (1, "shared_columns"),
    "gate_proj.weight": (0, "intermediate"), "up_proj.weight": (0, "intermediate"),
    "down_proj.weight": (1, "intermediate"),
    "linear_attn.in_proj_qkv.weight": (0, "linear_qkv"), "linear_attn.conv1d.weight": (0, "linear_qkv"),
    "linear_attn.in_proj_z.weight": (0, "value_rows"), "linear_attn.out_proj.weight": (1, "value_rows"),
    "linear_attn.in_proj_b.weight": (0, "value_heads"), "linear_attn.in_proj_a.weight": (0, "value_heads"),
    "linear_attn.dt_bias": (0, "value_heads"), "linear_attn.A_log": (0, "value_heads"),
    "mlp.w13": (1, "expert_columns"), "mlp.w2": (2, "expert_columns"),
    "embed_tokens.weight": (0, "vocab"), "lm_head.weight": (0, "vocab"),
}


@dataclass(frozen=True)
class Shard:
    rank: int
    world_size: int
    heads: range  # query heads
    kv_heads: range
    intermediate: range  # MLP columns
    vocab: range
    head_dim: int
    expert_columns: range = range(0)  # each expert's MLP columns (mixture-of-experts layers)
    expert_size: int = 0  # an expert's MLP columns in all
    query_width: int = 0  # a query head's q_proj rows: the head dim, twice that with an output gate
    shared_columns: range = range(0)  # the shared expert's MLP columns
    key_heads: range = range(0)  # linear attention's
    value_heads: range = range(0)
    linear: LinearAttention | None = None  # the whole linear-attention shape

    @classmethod
    def of(cls, config: DecoderConfig, rank: int, world_size: int) -> Shard:
        heads, kv, linear = config.num_heads, config.num_kv_heads, config.linear
        group = heads // kv
        sizes = supported_world_sizes(heads, kv, linear)
        if world_size not in sizes:
            linear_heads = f", {linear.num_key_heads} linear-attention key heads and {linear.num_value_heads} " \
                           f"value heads" if linear else ""
            raise CoreError(f"tensor parallelism over {world_size} ranks does not fit this model's {heads} attention "
                            f"heads{',' if linear else ' and'} {kv} KV heads{linear_heads}; supported world sizes: "
                            f"{', '.join(map(str, sizes))}")
        if world_size <= kv:
            kv_heads = balanced(kv, world_size, rank)
            own = range(kv_heads.start * group, kv_heads.stop * group)
        else:
            own = balanced(heads, world_size, rank)
            kv_heads = range(own.start // group, own.start // group + 1)
        key_heads = balanced(linear.num_key_heads, world_size, rank) if linear else range(0)
        value_heads = balanced(linear.num_value_heads, world_size, rank) if linear else range(0)
        return cls(rank, world_size, own, kv_heads, balanced(config.intermediate_size, world_size, rank),
                   balanced(config.vocab_size, world_size, rank), config.head_dim,
                   balanced(config.moe_intermediate_size, world_size, rank), config.moe_intermediate_size,
                   config.head_dim * (2 if config.attn_output_gate else 1),
                   balanced(config.shared_expert_intermediate_size, world_size, rank), key_heads, value_heads, linear)

    def local_config(self, config: DecoderConfig) -> DecoderConfig:
        """The config of this rank's part: its heads, KV heads, MLP columns and linear-attention heads; the
        vocabulary stays whole, since logits are gathered before sampling."""
        linear = self.linear and replace(self.linear, num_key_heads=len(self.key_heads),
                                         num_value_heads=len(self.value_heads))
        return replace(config, num_heads=len(self.heads), num_kv_heads=len(self.kv_heads),
                       intermediate_size=len(self.intermediate), moe_intermediate_size=len(self.expert_columns),
                       shared_expert_intermediate_size=len(self.shared_columns), linear=linear)

    def read(self, part, dim: int, by: str, block: int = 1, full: int = 0) -> torch.Tensor:  # noqa: ANN001
        """This rank's slice of one weight: `part` is safetensors' lazy slice (no public type), read from disk only
        where indexed. With `block` > 1, `part` is an FP8 weight's block scales, `block` elements of the weight (of
        `full` along `dim`) to an entry: the rank reads the blocks of its slice, which must hold it exactly."""
        if by == "expert_columns" and dim == 1:  # w13: the gate rows, then the same run of up rows
            own = self.span(by)
            up = slice(own.start + self.expert_size, own.stop + self.expert_size)
            return torch.cat([part[:, self._blocks(own, block, full)], part[:, self._blocks(up, block, full)]], dim=1)
        if by == "linear_qkv":  # q, k and v rows side by side: the rank's key heads' q and k, its value heads' v
            assert self.linear is not None and dim == 0
            keys, key_dim = self.span("key_rows"), self.linear.key_dim
            values = self.span("value_rows")
            rows = (keys, slice(keys.start + key_dim, keys.stop + key_dim),
                    slice(values.start + 2 * key_dim, values.stop + 2 * key_dim))
            return torch.cat([part[self._blocks(r, block, full)] for r in rows])
        index = (slice(None),) * dim + (self._blocks(self.span(by), block, full),)
        return part[index]

    def _blocks(self, span: slice, block: int, full: int) -> slice:
        if block == 1:
            return span
        if span.start % block or (span.stop % block and span.stop != full):
            raise CoreError(f"tensor parallelism over {self.world_size} ranks would split an FP8 weight inside its "
                            f"blocks of {block} (rank {self.rank} holds {span.start} to {span.stop} of {full}); "
                            "serve it on fewer ranks")
        return slice(span.start // block, -(-span.stop // block))

    def span(self, by: str) -> slice:
        """The rows (or columns) of a weight split `by` heads, KV heads, MLP columns, vocabulary or linear-attention
        heads."""
        part, unit = {
            "heads": (self.heads, self.head_dim), "kv_heads": (self.kv_heads, self.head_dim),
            "kv_head_scales": (self.kv_heads, 1),
            "query_rows": (self.heads, self.query_width),
            "key_rows": (self.key_heads, self.linear and self.linear.key_head_dim),
            "value_rows": (self.value_heads, self.linear and self.linear.value_head_dim),
        }.get(by) or (getattr(self, by), 1)
        return slice(part.start * unit, part.stop * unit)


def read_weights(path: Path, device: torch.device, shard: Shard | None,
                 fp8_block: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file; with a shard, only this rank's slice of each is read from disk. An FP8
    weight's values split as its weight does, their scales along with them (engine/model/fp8.py): per-channel
    scales with the weight's rows, replicated where its columns split; block scales (of `fp8_block`) by blocks."""
    state = {}
    with safe_open(path, framework="pt", device=str(device)) as file:
        for name in file.keys():
            weight = next((name.removesuffix(s) for s in fp8.SUFFIXES if name.endswith(s)), name)
            split = next((s for suffix, s in SPLITS.items() if weight.endswith(suffix)), None)
            if shard is None or split is None:
                state[name] = file.get_tensor(name)
                continue
            dim, by = split
            shape = file.get_slice(weight + fp8.VALUES).get_shape() if weight != name else []
            if name.endswith(fp8.CHANNEL_SCALE) and dim == len(shape) - 1:
                state[name] = file.get_tensor(name)  # one scale per output row: the same on every rank
            elif name.endswith(fp8.BLOCK_SCALE):
                block = fp8_block[0] if dim == len(shape) - 2 else fp8_block[1]
                state[name] = shard.read(file.get_slice(name), dim, by, block, shape[dim])
            else:
                state[name] = shard.read(file.get_slice(name), dim, by)
    return state
