"""What a decoder model is, per family: one `DecoderConfig` of features, read from the core's config (the Hugging
Face config.json as `ignition export` wrote it). See docs/design.md, Models and kernels.

A family is a set of features here plus, at most, a module for the layers only it has (engine/model/moe.py):
- llama: the base (Llama 2/3, SmolLM2, Mistral without a sliding window).
- qwen2: bias on q/k/v; optional sliding-window layers.
- qwen3: per-head RMSNorm on q and k; optional sliding-window layers.
- qwen3_moe, mixtral: qwen3's / llama's attention, sparse mixture-of-experts MLP.
- qwen3_vl: qwen3's text model (under the config's text_config) with multimodal rotary positions (M-RoPE: frequency
  i turns by the token's t, h or w position, interleaved by mrope_section), plus the vision tower
  (engine/model/qwen3_vl.py).
- gemma3_text: (1 + w) RMSNorm, norms before and after attention and MLP, embeddings scaled by sqrt(hidden), GeLU-tanh
  MLP, attention scale from query_pre_attn_scalar, q/k norm, interleaved sliding-window and global layers with their
  own rope bases.
- qwen3_5, qwen3_5_moe, qwen3_next: hybrids. Most layers are Gated DeltaNet linear attention
  (engine/model/linear_attention.py: a fixed-size recurrent state per request instead of KV), one in `full_attention`
  layers is gated attention (q_proj carries a sigmoid output gate beside q, per-head q/k norm, rotary on the first
  `partial_rotary_factor` of each head); (1 + w) RMSNorm without Gemma's extra norms. The MoE variants add a shared
  expert with its sigmoid gate to the routed experts (engine/model/moe.py). Qwen3.5's rotary is Qwen3-VL's
  interleaved M-RoPE over the rotated part of a head; a checkpoint with a vision_config (Qwen3_5ForConditionalGeneration
  and its MoE sibling) adds Qwen3-VL's vision tower, without deepstack (engine/model/qwen3_vl.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from common.errors import CoreError
from common.manifest import SUPPORTED_ARCHITECTURES as FAMILIES


@dataclass(frozen=True)
class Rope:
    theta: float
    scaling: tuple[tuple[str, object], ...] = ()  # the rope_parameters beyond theta and type, sorted
    kind: str = "default"  # "default" | "linear" | "llama3"

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """The frequencies of a head of `head_dim` rotated dimensions (the rotary part of a partial rope's head)."""
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        scaling = dict(self.scaling)
        if self.kind == "linear":
            return inv_freq / scaling["factor"]
        if self.kind == "llama3":
            # Llama 3.1: low frequencies stretched by `factor`, high ones kept, a smooth blend between.
            factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
            original = scaling["original_max_position_embeddings"]
            wavelen = 2 * math.pi / inv_freq
            smooth = (original / wavelen - low) / (high - low)
            blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
            inv_freq = torch.where(wavelen > original / low, inv_freq / factor,
                                   torch.where(wavelen < original / high, inv_freq, blended))
        return inv_freq


ROPE_KINDS = ("default", "linear", "llama3")


def rope_of(params: dict, where: str) -> Rope:
    """A rope from transformers' rope_parameters (or the older rope_theta + rope_scaling); an unknown type is an
    error naming it."""
    kind = str(params.get("rope_type", params.get("type", "default")))
    if kind not in ROPE_KINDS:
        raise CoreError(f"{where}: unsupported rope scaling {kind!r} (Flare implements {', '.join(ROPE_KINDS)})")
    kept = ("rope_theta", "rope_type", "type", "partial_rotary_factor", "mrope_section", "mrope_interleaved")
    extra = tuple(sorted((k, v) for k, v in params.items() if k not in kept))
    return Rope(float(params.get("rope_theta") or 10000.0), extra if kind != "default" else (), kind)


@dataclass(frozen=True)
class LinearAttention:
    """A Gated DeltaNet layer's shape: key heads (q and k) and value heads, each key head serving
    num_value_heads // num_key_heads value heads; a depthwise causal conv of `conv_kernel` over q, k and v."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:  # q, k and v side by side
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense MLP's
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    ropes: tuple[Rope, ...]  # the distinct ropes; layer i uses ropes[layer_rope[i]]
    layer_rope: tuple[int, ...]
    layer_window: tuple[int | None, ...]  # a layer's query sees this many keys (itself included); None: all
    qkv_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k, before rope
    gemma_norms: bool = False  # (1 + w) RMSNorm, and norms after attention and MLP too
    embed_scale: float = 1.0
    hidden_act: str = "silu"  # "silu" | "gelu_tanh"
    query_scale: float | None = None  # None: head_dim ** -0.5
    # Mixture of experts (num_experts 0: every MLP dense).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to one
    layer_moe: tuple[bool, ...] = ()
    mrope_section: tuple[int, ...] = ()  # M-RoPE: frequencies turned by t, h and w (interleaved); () plain rope
    # Hybrids (qwen3_5, qwen3_5_moe, qwen3_next).
    rotary_dim: int = 0  # the rotated leading dimensions of a head (partial rotary); 0: all of head_dim
    attn_output_gate: bool = False  # q_proj gives q and a sigmoid gate on the attention's output, per head
    zero_centered_norms: bool = False  # (1 + w) RMSNorm, without Gemma's norms after attention and MLP
    shared_expert_intermediate_size: int = 0  # MoE layers' shared expert (0: none)
    layer_linear: tuple[bool, ...] = ()  # Gated DeltaNet layers (the rest attend over the KV cache)
    linear: LinearAttention | None = None

    @property
    def plus_one_norms(self) -> bool:
        """RMSNorm scales by (1 + w) (engine/model/norms.py: GemmaRMSNorm)."""
        return self.gemma_norms or self.zero_centered_norms

    @property
    def rotated_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def hybrid(self) -> bool:
        """Whether some layers carry a recurrent state (engine/model/recurrent_state.py) rather than KV."""
        return any(self.layer_linear)

    def is_linear(self, layer: int) -> bool:
        return bool(self.layer_linear) and self.layer_linear[layer]

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers with KV in the cache, in order: a hybrid's cache holds its attention layers only."""
        return tuple(i for i in range(self.num_layers) if not self.is_linear(i))

    @property
    def attention_scale(self) -> float:
        return self.query_scale if self.query_scale is not None else self.head_dim ** -0.5

    def is_moe(self, layer: int) -> bool:
        return bool(self.layer_moe) and self.layer_moe[layer]

    @classmethod
    def from_hf(cls, family: str, config: dict, where: str = "config") -> DecoderConfig:
        if family not in FAMILIES:
            raise CoreError(f"{where}: unsupported architecture {family!r} (Flare serves {', '.join(FAMILIES)})")
        config = text_config(config)
        heads = int(config["num_attention_heads"])
        layers = int(config["num_hidden_layers"])
        hidden = int(config["hidden_size"])
        base = dict(
            vocab_size=int(config["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]), num_layers=layers, num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)))
        types = list(config.get("layer_types") or ["full_attention"] * layers)
        window = config.get("sliding_window")
        if family in ("mixtral", "qwen3_moe") and window:  # their window, when set, is on every layer
            types = ["sliding_attention"] * layers
        base["layer_window"] = tuple(int(window) if t == "sliding_attention" else None for t in types)
        ropes = _ropes(config, types, where)
        distinct = tuple(dict.fromkeys(ropes))
        base.update(ropes=distinct, layer_rope=tuple(distinct.index(r) for r in ropes))
        if family == "qwen2":
            base["qkv_bias"] = True
        if family in ("qwen3", "qwen3_moe", "qwen3_vl"):
            base.update(qk_norm=True, qkv_bias=bool(config.get("attention_bias", False)))
        if family in MROPE_SECTIONS:
            params = config.get("rope_parameters") or {}
            base["mrope_section"] = tuple(int(n) for n in params.get("mrope_section", MROPE_SECTIONS[family]))
        if family == "llama":
            base["qkv_bias"] = bool(config.get("attention_bias", False))
        if family == "gemma3_text":
            base.update(qk_norm=True, gemma_norms=True, embed_scale=hidden ** 0.5, hidden_act="gelu_tanh",
                        query_scale=float(config["query_pre_attn_scalar"]) ** -0.5,
                        qkv_bias=bool(config.get("attention_bias", False)))
        if family == "qwen3_moe":
            dense = set(config.get("mlp_only_layers") or [])
            step = int(config.get("decoder_sparse_step", 1))
            base.update(num_experts=int(config.get("num_experts") or config["num_local_experts"]), moe_intermediate_size=int(config["moe_intermediate_size"]),
                        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
                        layer_moe=tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)))
        if family == "mixtral":
            base.update(num_experts=int(config["num_local_experts"]), moe_intermediate_size=base["intermediate_size"],
                        norm_topk_prob=True, layer_moe=(True,) * layers)
        if family in HYBRIDS:
            _hybrid(base, family, config, types)
        if base.get("num_experts"):
            base["num_experts_per_tok"] = int(config["num_experts_per_tok"])
        return cls(**base)


HYBRIDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
# The families with M-RoPE, and the mrope_section transformers' rotary assumes when the config has none.
MROPE_SECTIONS = {"qwen3_vl": (24, 20, 20), "qwen3_5": (11, 11, 10), "qwen3_5_moe": (11, 11, 10)}


def _hybrid(base: dict, family: str, config: dict, types: list[str]) -> None:
    """What Qwen3.5 and Qwen3-Next add to the base: every layer is `linear_attention` or `full_attention`."""
    params = config.get("rope_parameters") or {}
    factor = float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    base.update(qk_norm=True, qkv_bias=bool(config.get("attention_bias", False)), attn_output_gate=True,
                zero_centered_norms=True, rotary_dim=int(base["head_dim"] * factor),
                layer_linear=tuple(t == "linear_attention" for t in types),
                linear=LinearAttention(int(config["linear_num_key_heads"]), int(config["linear_num_value_heads"]),
                                       int(config["linear_key_head_dim"]), int(config["linear_value_head_dim"]),
                                       int(config.get("linear_conv_kernel_dim", 4))))
    if family == "qwen3_5":
        return
    layers = base["num_layers"]
    dense = set(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step", 1))
    base.update(num_experts=int(config["num_experts"]), moe_intermediate_size=int(config["moe_intermediate_size"]),
                # Qwen3.5-MoE's router always renormalises its top k
                norm_topk_prob=bool(config.get("norm_topk_prob", True)),
                shared_expert_intermediate_size=int(config.get("shared_expert_intermediate_size") or 0),
                layer_moe=tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)))


def text_config(config: dict) -> dict:
    """A vision-language config's text model (its `text_config`, with the top level's word-embedding tying);
    any other config is its own."""
    if "text_config" not in config:
        return config
    return {**config["text_config"], "tie_word_embeddings": bool(config.get("tie_word_embeddings", False))}


def _ropes(config: dict, types: list[str], where: str) -> list[Rope]:
    """Each layer's rope. transformers 5 keeps rope_parameters, per layer type where the types differ (Gemma 3);
    Llama cores also carry the flat rope_theta and rope_scaling of transformers 4."""
    params = config.get("rope_parameters") or {}
    if all(isinstance(params.get(t), dict) for t in set(types)) and params:
        return [rope_of(params[t], where) for t in types]
    flat = {"rope_theta": config.get("rope_theta") or params.get("rope_theta") or 10000.0,
            **(config.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"})}
    return [rope_of(flat, where)] * len(types)
