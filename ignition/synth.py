"""`ignition synth`: a core with random weights of a real architecture, for benchmarks and tests (nothing is
downloaded). The tokenizer is a byte-level BPE built here to the architecture's vocabulary size: the 256 byte
symbols, then merges of ever longer pieces of printable ASCII, then the chat special tokens in the last ids.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from common.errors import CoreError
from common.manifest import GenerationDefaults
from ignition.export import DTYPES
from engine.model.config import HYBRIDS, text_config
from ignition.families import expected_shapes, family_of

BYTE_LEVEL_SPACE = "\u0120"  # how byte-level BPE spells a space ("Ġ")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VISION_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")  # before SPECIALS, so eos stays last
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                 "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                 "{% endif %}")
# Qwen2-VL's layout of a message's parts: each image part is its placeholder between vision markers.
VISION_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{% else %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}")
_LLAMA_3_1_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}
_GEMMA_3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
PRESETS: dict[str, dict[str, object]] = {
    "llama-3.1-8b": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                     "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": _LLAMA_3_1_ROPE,
                     "tie_word_embeddings": False},
    "llama-3.1-70b": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
                      "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
                      "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                      "rope_scaling": _LLAMA_3_1_ROPE, "tie_word_embeddings": False},
    "smollm2-135m": {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
                     "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True},
    "tiny": {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
             "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False},
    "qwen2.5-7b": {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
                   "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                   "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
                   "tie_word_embeddings": False},
    # Qwen3-Embedding-0.6B's architecture (Qwen3-0.6B's): what an embedding benchmark serves with --pooling last.
    "qwen3-0.6b": {"model_type": "qwen3", "vocab_size": 151669, "hidden_size": 1024, "intermediate_size": 3072,
                   "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
                   "tie_word_embeddings": True},
    "qwen3-8b": {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
                 "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
                 "tie_word_embeddings": False},
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                      "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                      "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                      "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
                      "tie_word_embeddings": False},
    "mixtral-8x7b": {"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                     "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 32768,
                     "rms_norm_eps": 1e-5, "rope_theta": 1_000_000.0, "tie_word_embeddings": False},
    # Gemma 3 12B's text model: 5 sliding-window layers (1024 keys, rope base 10k) to each global one (1M, linear 8).
    "gemma-3-12b": {"model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 3840, "intermediate_size": 15360,
                    "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
                    "query_pre_attn_scalar": 256, "sliding_window": 1024, "sliding_window_pattern": 6,
                    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_parameters": _GEMMA_3_ROPE,
                    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True},
    # Qwen3-VL-8B-Instruct: Qwen3-8B's shape with M-RoPE (t, h, w interleaved 24/20/20) and a 27-block tower.
    "qwen3-vl-8b": {"model_type": "qwen3_vl", "tie_word_embeddings": False, "text_config": {
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 5_000_000.0,
                                                  "mrope_section": [24, 20, 20], "mrope_interleaved": True}},
        "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                          "out_hidden_size": 4096, "num_position_embeddings": 2304, "patch_size": 16,
                          "spatial_merge_size": 2, "temporal_patch_size": 2, "deepstack_visual_indexes": [8, 16, 24],
                          "hidden_act": "gelu_pytorch_tanh"}},
    # Hybrids: three Gated DeltaNet layers to each gated attention layer (transformers derives layer_types from
    # full_attention_interval, so --layers keeps the pattern). Qwen3.5 as transformers' Qwen3.5-9B-style defaults;
    # Qwen3-Next-80B-A3B-Instruct's config.json.
    "qwen3.5-9b": {"model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288,
                   "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
                   "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                   "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "max_position_embeddings": 32768,
                   "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                   "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25}},
    "qwen3-next-80b-a3b": {"model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048,
                           "intermediate_size": 5120, "moe_intermediate_size": 512,
                           "shared_expert_intermediate_size": 512, "num_experts": 512, "num_experts_per_tok": 10,
                           "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                           "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
                           "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                           "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
                           "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                           "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0,
                                               "partial_rotary_factor": 0.25}},
}
# The vision presets' image processor (Qwen3-VL's preprocessor_config.json).
SYNTH_PREPROCESSOR = {"size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": 16,
                      "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
INIT_STD = 0.02  # Hugging Face's initializer_range for Llama


class SynthSource:
    """An ignition Source (ignition/export.py) whose config is a preset and whose tensors are random."""

    def __init__(self, preset: str, layers: int | None, dtype: str, seed: int) -> None:
        if preset not in PRESETS:
            raise CoreError(f"synth:{preset}: unknown preset (one of {', '.join(PRESETS)})")
        self.path = self.config_file = Path(f"synth:{preset}")
        self.checkpoint = f"synthetic/{preset}" + (f"-{layers}-layers" if layers else "")
        self.default_dtype = dtype
        self.default_names = [self.checkpoint.split("/")[1]]
        self.generation = GenerationDefaults()
        preset_config = PRESETS[preset]
        vision = "vision_config" in preset_config
        self.chat_template = VISION_CHAT_TEMPLATE if vision else CHAT_TEMPLATE
        self.pooling = None
        self.specials = (VISION_SPECIALS if vision else ()) + SPECIALS
        self.preprocessor = SYNTH_PREPROCESSOR if vision else {}
        self.preprocessor_file = self.path
        vocab = int(text_config(preset_config)["vocab_size"])
        self._config = {**preset_config, "bos_token_id": vocab - len(SPECIALS), "eos_token_id": vocab - 1}
        if vision:  # the placeholder ids are the vision specials' (byte_level_bpe puts the specials last)
            first = vocab - len(self.specials)
            self._config["text_config"] = dict(preset_config["text_config"])
            self._config.update(vision_start_token_id=first, vision_end_token_id=first + 1,
                                image_token_id=first + 2, video_token_id=first + 2)
        if layers:
            (self._config["text_config"] if vision else self._config)["num_hidden_layers"] = layers
        self._family = family_of(self._config, self.path)
        # Norm weights start at a scale of one, as trained ones roughly do: Gemma and the hybrids store w for a scale
        # of 1 + w (the hybrids' gated norm in linear attention excepted).
        self._norm_fill = 0.0 if self._family in ("gemma3_text", *HYBRIDS) else 1.0
        self.generation_eos_ids = [vocab - len(SPECIALS), vocab - 1]
        self._dtype = DTYPES[dtype]
        self._seed = seed

    def config(self) -> dict[str, object]:
        return dict(self._config)

    def write_tokenizer(self, target: Path) -> list[int]:
        tokenizer = byte_level_bpe(int(text_config(self._config)["vocab_size"]), self.specials)
        tokenizer.save(str(target))
        return [tokenizer.token_to_id(SPECIALS[-1])]

    def quantized_bits(self, name: str) -> int | None:
        return None  # dense weights stay dense unless export is asked for --quant

    def tensor_count(self) -> int:
        return len(self._shapes())

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Core names and layouts already (core_tensors passes them through)."""
        # A GPU draws an 8B core's weights in seconds where a CPU takes minutes (the seed's stream differs by device).
        device = "cuda" if torch.cuda.is_available() else "cpu"
        generator = torch.Generator(device).manual_seed(self._seed)
        for name, shape in self._shapes().items():
            if name.endswith(".weight") and "norm" in name.split(".")[-2]:  # RMSNorm, LayerNorm (norm1, ...)
                fill = 1.0 if name.endswith("linear_attn.norm.weight") else self._norm_fill
                yield name, torch.full(shape, fill, dtype=self._dtype)
            else:
                weight = torch.empty(shape, dtype=self._dtype, device=device)
                yield name, weight.normal_(0, INIT_STD, generator=generator).cpu()

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        from ignition.families import normalised_config

        _, config = normalised_config(self.config(), self.path, str(self._dtype).removeprefix("torch."), "")
        return expected_shapes(self._family, config)


def byte_level_bpe(vocab_size: int, specials: tuple[str, ...] = SPECIALS) -> Tokenizer:
    """A byte-level BPE of exactly `vocab_size` ids: bytes, merges of printable ASCII (letters and digits first),
    special tokens.

    Only the 256 byte tokens can be part of a character: as in real vocabularies (0.6% of SmolLM2's tokens are not
    valid UTF-8 alone), a random-weight model's tokens are nearly all whole text. With merges over every byte, 72%
    were not, and a stream's detokenizer held them back, so a client's TTFT and inter-token times on a synth core
    measured those hold-backs rather than the server (docs/gpu.md, Serving)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda ch: (not ch.isalnum(), ch))
    regular = vocab_size - len(specials)
    if regular < len(alphabet):
        raise CoreError(f"a byte-level vocabulary needs more than {len(alphabet) + len(specials)} ids")
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges: list[tuple[str, str]] = []
    printable = [ch for ch in alphabet if "!" <= ch <= "~"] + [BYTE_LEVEL_SPACE]
    pieces = printable
    while len(vocab) < regular:  # each round appends every existing piece + every printable byte, until full
        grown = []
        for left, right in itertools.product(pieces, printable):
            if len(vocab) == regular:
                break
            if left + right not in vocab:
                vocab[left + right] = len(vocab)
                merges.append((left, right))
                grown.append(left + right)
        pieces = grown
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in specials])
    return tokenizer
