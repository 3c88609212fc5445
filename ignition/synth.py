"""`ignition synth`: a core with random weights of a real architecture, for benchmarks and tests (nothing is
downloaded). The tokenizer is a byte-level BPE built here to the architecture's vocabulary size: the 256 byte
symbols, then merges of ever longer pieces, then the chat special tokens in the last ids.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from common.errors import CoreError
from common.manifest import GenerationDefaults
from ignition.export import DTYPES, expected_shapes

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                 "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                 "{% endif %}")
_LLAMA_3_1_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}
PRESETS: dict[str, dict[str, object]] = {
    "llama-3.1-8b": {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                     "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": _LLAMA_3_1_ROPE,
                     "tie_word_embeddings": False},
    "smollm2-135m": {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
                     "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True},
    "tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
             "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False},
}
INIT_STD = 0.02  # Hugging Face's initializer_range for Llama


class SynthSource:
    """An ignition Source (ignition/export.py) whose config is a preset and whose tensors are random."""

    def __init__(self, arch: str, preset: str, layers: int | None, dtype: str, seed: int) -> None:
        if arch != "llama":
            raise CoreError(f"synth:{preset}: unsupported architecture {arch}")
        if preset not in PRESETS:
            raise CoreError(f"synth:{preset}: unknown preset (one of {', '.join(PRESETS)})")
        self.path = self.config_file = Path(f"synth:{preset}")
        self.checkpoint = f"synthetic/{preset}" + (f"-{layers}-layers" if layers else "")
        self.default_dtype = dtype
        self.default_names = [self.checkpoint.split("/")[1]]
        self.chat_template = CHAT_TEMPLATE
        self.generation = GenerationDefaults()
        vocab = int(PRESETS[preset]["vocab_size"])
        self._config = {"model_type": "llama", **PRESETS[preset], "hidden_act": "silu",
                        "bos_token_id": vocab - len(SPECIALS), "eos_token_id": vocab - 1}
        if layers:
            self._config["num_hidden_layers"] = layers
        self.generation_eos_ids = [vocab - len(SPECIALS), vocab - 1]
        self._dtype = DTYPES[dtype]
        self._seed = seed

    def config(self) -> dict[str, object]:
        return dict(self._config)

    def write_tokenizer(self, target: Path) -> list[int]:
        tokenizer = byte_level_bpe(int(self._config["vocab_size"]))
        tokenizer.save(str(target))
        return [tokenizer.token_to_id(SPECIALS[-1])]

    def quantized_bits(self, name: str) -> int | None:
        return None  # dense weights stay dense unless export is asked for --quant

    def tensor_count(self) -> int:
        return len(expected_shapes(self._config))

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        generator = torch.Generator().manual_seed(self._seed)
        for name, shape in expected_shapes(self._config).items():
            if len(shape) == 1:  # norms start at one, as trained ones roughly do
                yield name, torch.ones(shape, dtype=self._dtype)
            else:
                yield name, torch.empty(shape, dtype=self._dtype).normal_(0, INIT_STD, generator=generator)


def byte_level_bpe(vocab_size: int) -> Tokenizer:
    """A byte-level BPE of exactly `vocab_size` ids: bytes, merges (printable pieces first), special tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda ch: (not ch.isalnum(), ch))
    regular = vocab_size - len(SPECIALS)
    if regular < len(alphabet):
        raise CoreError(f"a byte-level vocabulary needs more than {len(alphabet) + len(SPECIALS)} ids")
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges: list[tuple[str, str]] = []
    pieces = list(alphabet)
    while len(vocab) < regular:  # each round appends every existing piece + every byte, until the vocab is full
        grown = []
        for left, right in itertools.product(pieces, alphabet):
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
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in SPECIALS])
    return tokenizer
