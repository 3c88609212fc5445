"""What export knows per model family: the config (normalised by transformers' own config class, checked for what
Flare does not implement), the tensors a core holds, and the renaming from a checkpoint's tensor names to the core's
(engine/model/config.py is the engine's side).

A core keeps Hugging Face names, except for mixture-of-experts layers, whose experts are stacked as the fused kernel
reads them (engine/model/moe.py): `mlp.gate.weight [E, H]` (the router), `mlp.w13 [E, 2I, H]` (each expert's gate
rows, then its up rows) and `mlp.w2 [E, H, I]`; and for Qwen3-Next's linear attention, whose projections a core holds
in Qwen3.5's layout (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`: engine/model/linear_attention.py), not
interleaved per key head (`in_proj_qkvz`, `in_proj_ba`). A checkpoint's multi-token-prediction head (`mtp.`) is left
out: the engine does not speculate with it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from common.errors import CoreError
from engine.model.config import HYBRIDS, DecoderConfig
from ignition import fp8, qwen3_vl

# Checkpoint model_type -> Flare family. Mistral without a sliding window is Llama; a multimodal Gemma 3 (`gemma3`)
# exports its text model, without the vision tower; Qwen3-VL and multimodal Qwen3.5 (`qwen3_5`, `qwen3_5_moe`)
# export theirs (ignition/qwen3_vl.py).
FAMILY = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe",
          "mixtral": "mixtral", "gemma3_text": "gemma3_text", "gemma3": "gemma3_text", "qwen3_vl": "qwen3_vl",
          "qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe", "qwen3_next": "qwen3_next",
          "qwen3_5": "qwen3_5", "qwen3_5_moe": "qwen3_5_moe"}
# A multimodal checkpoint's text-model prefixes (original and transformers 5 layouts), and its other parts.
_TEXT_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                  "language_model.lm_head.": "lm_head."}
_NOT_TEXT = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.", "mtp.")
# A base model's tensors (Qwen3Model, as a sentence-transformers checkpoint saves it) lack the causal LM's "model.".
_BASE_MODEL = ("embed_tokens.", "layers.", "norm.")
# Config flags that change the function computed and that Flare does not implement: (key, the value that is fine).
_UNSUPPORTED = (("attn_logit_softcapping", None), ("final_logit_softcapping", None), ("mlp_bias", False),
                ("use_bidirectional_attention", False), ("partial_rotary_factor", 1.0))
_ACTIVATION = {"gemma3_text": "gelu_pytorch_tanh"}  # every other family: silu
# Checkpoint expert tensors: per expert (layer, expert, which), or stacked over experts (layer, which): gate_up_proj
# as transformers 5 holds it, gate_proj, up_proj and down_proj as GGUF does (ignition/gguf_source.py).
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_STACKED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|gate_proj|up_proj|down_proj)$")
_W13 = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1}
_W2 = ("down_proj", "w2")


def family_of(raw: dict[str, object], where: Path) -> str:
    model_type = raw.get("model_type")
    if model_type not in FAMILY:
        served = ", ".join(sorted(FAMILY))
        raise CoreError(f"{where}: unsupported architecture {model_type} (Flare exports {served})")
    return FAMILY[str(model_type)]


def normalised_config(raw: dict[str, object], where: Path, dtype: str, checkpoint: str) -> tuple[str, dict]:
    """(family, the config as the family's transformers config class writes it); an unsupported feature is a
    CoreError naming it."""
    family = family_of(raw, where)
    if raw.get("model_type") == "gemma3":
        raw = text_config(raw)
    if family == "llama":
        config = _llama_config(raw, where)
    else:
        config = _transformers_config(raw, where)
        config["model_type"] = raw["model_type"]
    for key, fine in _UNSUPPORTED:
        if key == "partial_rotary_factor" and family in HYBRIDS:
            continue  # their attention rotates part of each head
        if config.get(key) not in (None, fine):
            raise CoreError(f"{where}: unsupported {raw.get('model_type')} feature {key}={config[key]}")
    activation = config.get("hidden_activation") or config.get("hidden_act") or "silu"
    if activation != _ACTIVATION.get(family, "silu"):
        raise CoreError(f"{where}: unsupported {raw.get('model_type')} feature hidden_act={activation}")
    config.update(architectures=[_class_name(raw)], dtype=dtype, _name_or_path=checkpoint)
    # The checkpoint's quantization (ignition/fp8.py reads it) describes its files, not the core's: the manifest's
    # `quantization` names the core's layout.
    config.pop("quantization_config", None)
    DecoderConfig.from_hf(family, config, str(where))  # the engine must read it: e.g. an unknown rope type fails here
    try:
        return family, json.loads(json.dumps(config))
    except (TypeError, ValueError) as exc:
        raise CoreError(f"{where}: config is not JSON-serialisable: {exc}") from None


def text_config(raw: dict[str, object]) -> dict[str, object]:
    """A multimodal Gemma 3's text model config: its text_config, which ties the head to the embeddings."""
    text = dict(raw.get("text_config") or {})
    return {"tie_word_embeddings": raw.get("tie_word_embeddings", True), **text, "model_type": "gemma3_text",
            "architectures": ["Gemma3ForCausalLM"]}


def _class_name(raw: dict[str, object]) -> str:
    names = raw.get("architectures")
    return str(names[0]) if isinstance(names, list) and names else "LlamaForCausalLM"


def _transformers_config(raw: dict[str, object], where: Path) -> dict:
    from transformers import AutoConfig

    cleaned = {k: v for k, v in raw.items() if k not in ("model_type", "architectures")}
    try:
        return AutoConfig.for_model(str(raw["model_type"]), **cleaned).to_dict()
    except Exception as exc:  # transformers validates the config in many ways
        raise CoreError(f"{where}: invalid {raw['model_type']} config: {exc}") from None


def _llama_config(raw: dict[str, object], where: Path) -> dict:
    """transformers' LlamaConfig.to_dict(), plus the flat `rope_theta` and `rope_scaling` of transformers 4."""
    from transformers import LlamaConfig

    model_type = raw.get("model_type")
    window, positions = raw.get("sliding_window"), raw.get("max_position_embeddings")
    if window and not (isinstance(window, int) and isinstance(positions, int) and window >= positions):
        raise CoreError(f"{where}: unsupported architecture {model_type} with a sliding window of {window}")
    if raw.get("attention_bias"):
        raise CoreError(f"{where}: unsupported architecture {model_type} with attention_bias")
    cleaned = {k: v for k, v in raw.items() if k not in ("model_type", "sliding_window", "architectures")}
    try:
        config = LlamaConfig.from_dict(cleaned).to_dict()
    except Exception as exc:
        raise CoreError(f"{where}: invalid llama config: {exc}") from None
    rope = dict(config.get("rope_parameters") or {})
    config["rope_theta"] = float(rope.pop("rope_theta", 10000.0))
    config["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    config["architectures"] = ["LlamaForCausalLM"]
    return config


def expected_shapes(family: str, config: dict[str, object]) -> dict[str, tuple[int, ...]]:
    """Every tensor a core of this family holds, by core name."""
    c = DecoderConfig.from_hf(family, config)
    hidden = c.hidden_size
    shapes = {"model.embed_tokens.weight": (c.vocab_size, hidden), "model.norm.weight": (hidden,)}
    if qwen3_vl.has_vision(config):
        shapes |= qwen3_vl.vision_shapes(config)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, hidden)
    norms = ["input_layernorm", "post_attention_layernorm"]
    if c.gemma_norms:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for i in range(c.num_layers):
        layer = f"model.layers.{i}."
        shapes |= {layer + f"{norm}.weight": (hidden,) for norm in norms}
        if c.is_linear(i):
            shapes |= _linear_attention_shapes(c, layer + "linear_attn.")
        else:
            shapes |= _attention_shapes(c, layer + "self_attn.")
        mlp = layer + "mlp."
        if c.is_moe(i):
            experts, inter = c.num_experts, c.moe_intermediate_size
            shapes |= {mlp + "gate.weight": (experts, hidden), mlp + "w13": (experts, 2 * inter, hidden),
                       mlp + "w2": (experts, hidden, inter)}
            if c.shared_expert_intermediate_size:
                shapes |= _mlp_shapes(mlp + "shared_expert.", hidden, c.shared_expert_intermediate_size)
                shapes[mlp + "shared_expert_gate.weight"] = (1, hidden)
        else:
            shapes |= _mlp_shapes(mlp, hidden, c.intermediate_size)
    return shapes


def _mlp_shapes(mlp: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {mlp + "gate_proj.weight": (inter, hidden), mlp + "up_proj.weight": (inter, hidden),
            mlp + "down_proj.weight": (hidden, inter)}


def _linear_attention_shapes(c: DecoderConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    linear, hidden = c.linear, c.hidden_size
    heads = linear.num_value_heads
    return {prefix + "in_proj_qkv.weight": (linear.conv_dim, hidden),
            prefix + "in_proj_z.weight": (linear.value_dim, hidden), prefix + "in_proj_b.weight": (heads, hidden),
            prefix + "in_proj_a.weight": (heads, hidden),
            prefix + "conv1d.weight": (linear.conv_dim, 1, linear.conv_kernel), prefix + "dt_bias": (heads,),
            prefix + "A_log": (heads,), prefix + "norm.weight": (linear.value_head_dim,),
            prefix + "out_proj.weight": (hidden, linear.value_dim)}


def _attention_shapes(c: DecoderConfig, attn: str) -> dict[str, tuple[int, ...]]:
    hidden, head = c.hidden_size, c.head_dim
    q, kv = c.num_heads * head, c.num_kv_heads * head
    shapes = {attn + "q_proj.weight": ((2 if c.attn_output_gate else 1) * q, hidden),
              attn + "k_proj.weight": (kv, hidden), attn + "v_proj.weight": (kv, hidden),
              attn + "o_proj.weight": (hidden, q)}
    if c.qkv_bias:
        shapes |= {attn + "q_proj.bias": (shapes[attn + "q_proj.weight"][0],), attn + "k_proj.bias": (kv,),
                   attn + "v_proj.bias": (kv,)}
    if c.qk_norm:
        shapes |= {attn + "q_norm.weight": (head,), attn + "k_norm.weight": (head,)}
    return shapes


def core_tensors(family: str, config: dict[str, object],
                 tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors under core names; a layer's experts come out stacked once the last has been read
    (FP8 experts with their scales, ignition/fp8.py)."""
    c = DecoderConfig.from_hf(family, config)
    num_experts = c.num_experts
    vision = qwen3_vl.has_vision(config)
    pending: dict[str, dict[tuple[int, int], torch.Tensor]] = {}  # layer prefix -> {(expert, part): tensor}
    for name, tensor in tensors:
        name = qwen3_vl.core_name(name) if vision else name
        if name.startswith(_NOT_TEXT):
            continue
        prefix = next((p for p in _TEXT_PREFIXES if name.startswith(p)), None)
        if prefix:
            name = _TEXT_PREFIXES[prefix] + name.removeprefix(prefix)
        elif name.startswith(_BASE_MODEL):
            name = "model." + name
        name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's MoE block
        if name.endswith((".linear_attn.in_proj_qkvz.weight", ".linear_attn.in_proj_ba.weight")):
            if isinstance(tensor, fp8.Fp8Weight):  # split by heads, which need not align with its blocks
                tensor = tensor.dequantize()
            yield from _split_interleaved(c, name, tensor)
            continue
        if (match := _STACKED.match(name)):
            layer = f"model.layers.{match[1]}.mlp."
            if match[2] in ("gate_proj", "up_proj"):  # joined into w13 once both are read
                halves = pending.setdefault(layer, {})
                halves[(-1, _W13[match[2]])] = tensor
                if len(halves) == 2:
                    del pending[layer]
                    yield layer + "w13", fp8.cat([halves[(-1, 0)], halves[(-1, 1)]], dim=1)
                continue
            yield layer + ("w13" if match[2] == "gate_up_proj" else "w2"), tensor
            continue
        match = _EXPERT.match(name)
        if match is None:
            yield name, tensor
            continue
        layer, expert, which = f"model.layers.{match[1]}.mlp.", int(match[2]), match[3]
        part = _W13.get(which, 2 if which in _W2 else None)
        if part is None or expert >= num_experts:
            yield name, tensor  # export rejects it as unexpected
            continue
        parts = pending.setdefault(layer, {})
        parts[(expert, part)] = tensor
        if len(parts) == 3 * num_experts:
            del pending[layer]
            yield layer + "w13", fp8.stack([fp8.cat([parts[(e, 0)], parts[(e, 1)]], dim=0) for e in range(num_experts)])
            yield layer + "w2", fp8.stack([parts[(e, 2)] for e in range(num_experts)])
    # Layers whose experts are incomplete are left out: export names the missing tensor.


def _split_interleaved(c: DecoderConfig, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Qwen3-Next's fused projections, interleaved per key head ([q, k, v, z] rows of each key head's group of value
    heads; [b, a] likewise), as Qwen3.5's separate ones: q of every head, then k, then v (the conv's channel order),
    value heads in key-head order."""
    linear, prefix = c.linear, name.rsplit(".in_proj_", 1)[0] + "."
    group = linear.num_value_heads // linear.num_key_heads
    if name.endswith("in_proj_ba.weight"):
        b, a = tensor.reshape(linear.num_key_heads, 2 * group, -1).split((group, group), dim=1)
        yield prefix + "in_proj_b.weight", b.reshape(-1, tensor.shape[-1])
        yield prefix + "in_proj_a.weight", a.reshape(-1, tensor.shape[-1])
        return
    per_head = (linear.key_head_dim, linear.key_head_dim, group * linear.value_head_dim,
                group * linear.value_head_dim)
    if tensor.dim() != 2 or tensor.shape[0] != linear.num_key_heads * sum(per_head):
        yield name, tensor  # export names the unexpected tensor
        return
    q, k, v, z = (part.reshape(-1, tensor.shape[-1])
                  for part in tensor.reshape(linear.num_key_heads, sum(per_head), -1).split(per_head, dim=1))
    yield prefix + "in_proj_qkv.weight", torch.cat((q, k, v))
    yield prefix + "in_proj_z.weight", z
