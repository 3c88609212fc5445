"""A GGUF file (llama.cpp's format) as an ignition source: metadata, tokenizer, and weights as blocks or dequantized."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import torch

from common.errors import CoreError
from common.manifest import GenerationDefaults
from ignition.quantize import Blocks, gguf_blocks, unpermute_rows

# GGUF architectures read, each as the Hugging Face model_type transformers gives its config.
ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma3")
# llama.cpp tensor names -> Hugging Face names (per-expert tensors stay stacked: ignition/families.py joins them).
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# Gemma 3 normalises each branch's output too; llama.cpp's ffn_norm is then the MLP's input norm.
_GEMMA_LAYER_NAMES = {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                      "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
# "SmolLM2-135M-Instruct.Q4_1" -> "SmolLM2-135M-Instruct": the quantization is not part of the model's name.
_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d\w*|BF16|F16|F32)$", re.IGNORECASE)
_HF_URL = re.compile(r"^https?://(?:www\.)?huggingface\.co/([\w.-]+/[\w.-]+?)/?$")
_URL_KEYS = ("general.source.repo_url", "general.source.url", "general.repo_url", "general.url")
_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
# llama.cpp's end-of-turn and end-of-message tokens end generation just like EOS.
_END_ID_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


class GgufSource:
    """Opening validates the file (a truncated or corrupt one fails here, before any work) and its architecture."""

    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader

        self.path = path
        self.config_file = path
        try:
            self._reader = GGUFReader(path)
        except Exception as exc:  # gguf raises assorted ValueError/IndexError/struct errors on a damaged file
            raise CoreError(f"{path}: not a readable GGUF file (truncated or corrupt?): {exc}") from None
        architecture = self._field("general.architecture")
        if architecture not in ARCHITECTURES:
            raise CoreError(f"{path}: unsupported architecture {architecture} (Flare reads {', '.join(ARCHITECTURES)})")
        self._arch = str(architecture)
        template = self._field("tokenizer.chat_template")
        if not isinstance(template, str) or not template.strip():
            raise CoreError(f"{path}: no chat template in the GGUF metadata (tokenizer.chat_template)")
        self.chat_template: str = template
        self.pooling = None  # a GGUF file is served as a generation core (flare run --pooling makes it embed)
        self.default_dtype = "float32"  # GGUF weights are quantized; dequantized values are exact in fp32
        self.checkpoint = path.name
        sampling = {name: self._field(key) for key, name in _SAMPLING_KEYS.items() if self._field(key) is not None}
        try:
            self.generation = msgspec.convert(sampling, GenerationDefaults, strict=False)
        except msgspec.ValidationError as exc:
            raise CoreError(f"{path}: general.sampling metadata: {exc}") from None
        self.generation_eos_ids = [int(i) for i in map(self._field, _END_ID_KEYS) if i is not None]
        heads = self._field(f"{architecture}.attention.head_count")
        kv_heads = self._field(f"{architecture}.attention.head_count_kv")
        if heads is None:
            raise CoreError(f"{path}: no {architecture}.attention.head_count in the GGUF metadata")
        self._heads = (int(heads), int(kv_heads if kv_heads is not None else heads))
        self._types: dict[str, str] = {}  # GGUF type of each tensor yielded, by name

    @property
    def default_names(self) -> list[str]:
        stem = _QUANT_SUFFIX.sub("", self.path.name.removesuffix(".gguf"))
        names = [stem.lower()]
        repo = self._repo_id(stem)
        if repo and repo not in names:
            names.append(repo)
        return names

    def config(self) -> dict[str, object]:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(str(self.path.parent), gguf_file=self.path.name).to_dict()
        except Exception as exc:  # transformers reports missing or odd metadata in many ways
            raise CoreError(f"{self.path}: cannot read the model config from the GGUF metadata: {exc}") from None
        return self._with_what_transformers_drops(config)

    def _with_what_transformers_drops(self, config: dict[str, object]) -> dict[str, object]:
        """Metadata that transformers' GGUF config reader leaves out but the function depends on."""
        arch = self._arch
        head_dim = self._field(f"{arch}.attention.key_length")
        if head_dim is not None:
            config["head_dim"] = int(head_dim)
        if arch == "qwen3moe":  # llama.cpp always renormalises Qwen3-MoE's top-k weights
            config.update(moe_intermediate_size=int(self._field("qwen3moe.expert_feed_forward_length")),
                          norm_topk_prob=True)
        scaling = self._field(f"{arch}.rope.scaling.type")
        if scaling not in (None, "none"):
            if arch != "gemma3" or scaling != "linear":
                raise CoreError(f"{self.path}: unsupported {arch} rope scaling {scaling} in the GGUF metadata")
            # Gemma 3: the global layers' rope is scaled; the sliding ones keep base 10000 (as llama.cpp has it).
            theta = float(self._field("gemma3.rope.freq_base") or 1_000_000.0)
            config["rope_parameters"] = {
                "full_attention": {"rope_type": "linear", "factor": float(self._field("gemma3.rope.scaling.factor")),
                                   "rope_theta": theta},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
        return config

    def write_tokenizer(self, target: Path) -> list[int]:
        """Convert the GGUF vocabulary to a `tokenizers` tokenizer.json; return the tokenizer's EOS ids."""
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name)
        except Exception as exc:
            raise CoreError(f"{self.path}: cannot convert the GGUF tokenizer: {exc}") from None
        tokenizer.backend_tokenizer.save(str(target))
        return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def tensor_count(self) -> int:
        return len(self._reader.tensors)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor | Blocks]]:
        """Tensors under Hugging Face names, undoing what llama.cpp's converter did: Llama's q/k rows back in
        Hugging Face order, Gemma's norm weights back from 1 + w to w. Q4_0, Q4_1 and Q8_0 matrices come as their
        blocks (ignition/quantize.py), every other tensor dequantized to fp32."""
        from gguf import dequantize

        heads, kv_heads = self._heads
        for tensor in self._reader.tensors:
            name = self._hf_name(tensor.name)
            self._types[name] = tensor.tensor_type.name
            unpermute = None
            if self._arch == "llama" and name.endswith("q_proj.weight"):
                unpermute = lambda w: _unpermute(w, heads)  # noqa: E731
            elif self._arch == "llama" and name.endswith("k_proj.weight"):
                unpermute = lambda w: _unpermute(w, kv_heads)  # noqa: E731
            shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the fastest dimension first
            blocks = gguf_blocks(tensor.data, tensor.tensor_type.name, shape) if len(shape) == 2 else None
            if blocks is not None:
                yield name, unpermute_rows(blocks, unpermute) if unpermute else blocks
                continue
            try:
                weights = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            except Exception as exc:
                raise CoreError(f"{self.path}: cannot dequantize {tensor.name}: {exc}") from None
            if self._arch == "gemma3" and name.endswith("norm.weight"):
                weights = weights - 1
            yield name, torch.from_numpy(unpermute(weights) if unpermute else weights)

    def quantized_bits(self, name: str) -> int | None:
        """The bit width a weight keeps by default (its GGUF type's): None for a float type."""
        kind = self._types.get(name, "F32")  # a name export derived (stacked experts) stays dense
        if kind in ("F32", "F16", "BF16", "F64"):
            return None
        return 4 if kind.startswith(("Q4", "IQ4", "Q3", "IQ3", "Q2", "IQ2", "IQ1")) else 8

    def _hf_name(self, gguf_name: str) -> str:
        base = gguf_name.removesuffix(".weight")
        if base in _GLOBAL_NAMES and gguf_name.endswith(".weight"):
            return f"{_GLOBAL_NAMES[base]}.weight"
        match = _LAYER_TENSOR.match(gguf_name)
        names = _GEMMA_LAYER_NAMES if self._arch == "gemma3" else _LAYER_NAMES
        if match and match[2] in names:
            stacked = match[2].endswith("_exps")  # one [E, ...] tensor per kind, named without .weight
            return f"model.layers.{match[1]}.{names[match[2]]}" + ("" if stacked else f".{match[3]}")
        if base == "rope_freqs":
            raise CoreError(f"{self.path}: unsupported rope_freqs tensor (Llama 3 rope scaling in GGUF)")
        raise CoreError(f"{self.path}: unexpected tensor {gguf_name} for a {self._arch} model")

    def _repo_id(self, stem: str) -> str | None:
        for key in _URL_KEYS:
            url = self._field(key)
            if isinstance(url, str) and (match := _HF_URL.match(url.strip())):
                return match[1]
        # Files converted by llama.cpp name their organization and keep the repository's name as the file's.
        organization = self._field("general.organization")
        return f"{organization}/{stem}" if isinstance(organization, str) and organization else None

    def _field(self, key: str) -> object:
        field = self._reader.get_field(key)
        return None if field is None else field.contents()


def _unpermute(weights: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp's converter interleaves the two rotary halves of each head (it rotates adjacent pairs);
    # Hugging Face rotates the first half against the second. This undoes convert_hf_to_gguf.py's permute.
    rows = weights.shape[0]
    return weights.reshape(heads, rows // heads // 2, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)
