"""`ignition export`: tiny checkpoints made here (a Hugging Face directory and a GGUF written like llama.cpp's
converter writes one), the one-line errors of the real command, and the real SmolLM2 GGUF when it is present."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM

from common.errors import CoreError
from common.manifest import load_manifest
from engine.executor.eager import kv_cache_shape
from engine.model.attention import AttentionMetadata, PrefillSpan
from engine.model.loader import load_model
from engine.model.quant import dequantize_all
from ignition.export import ExportOptions, export

REPO = Path(__file__).resolve().parents[2]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TEXTS = ["hello world", "the cat sat on the mat", "a dog ran in the park", "hello cat, hello dog"] * 4


def _tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TEXTS, trainer)
    return tokenizer


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random two-layer Llama saved in shards, with a chatml tokenizer config and a generation config."""
    root = tmp_path_factory.mktemp("hf") / "Tiny-Llama-Chat"
    tokenizer = _tokenizer()
    config = LlamaConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, bos_token_id=1, eos_token_id=0, rope_theta=50000.0,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(root, max_shard_size="100KB")
    tokenizer.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHATML}))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2], "temperature": 0.7}))
    return root


@pytest.fixture(scope="module")
def gguf_file(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint as llama.cpp's convert_hf_to_gguf.py writes it: renamed, q/k rows permuted, F32."""
    path = tmp_path_factory.mktemp("gguf") / "Tiny-Llama-Chat.Q8_0.gguf"
    config = json.loads((hf_dir / "config.json").read_text())
    spec = json.loads(Tokenizer.from_file(str(hf_dir / "tokenizer.json")).to_str())["model"]
    tokens = sorted(spec["vocab"], key=spec["vocab"].get)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_organization("TinyOrg")
    writer.add_block_count(2)
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in SPECIALS else 1 for token in tokens])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in spec["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHATML)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    for name, tensor in _weights(hf_dir).items():
        array = tensor.float().numpy()
        if "q_proj" in name or "k_proj" in name:
            array = _llama_cpp_permute(array, config["num_attention_heads" if "q_proj" in name else
                                                     "num_key_value_heads"])
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    # Verbatim from llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute).
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        weights |= load_file(shard)
    return weights


def _ignition(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ignition.main", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_hf_directory_exports_to_a_verified_core(hf_dir: Path, tmp_path: Path) -> None:
    assert (hf_dir / "model.safetensors.index.json").is_file()  # the sharded layout is what is tested
    core = tmp_path / "core"
    export(hf_dir, core, ExportOptions(context_limit=128))
    manifest = load_manifest(core, verify=True)
    assert manifest.architecture == "llama" and manifest.dtype == "bfloat16"
    assert manifest.served_names == ["tiny-llama-chat"]
    assert manifest.context_limit == 128
    assert manifest.eos_token_ids == [2, 0]  # tokenizer's <|im_end|>, then generation_config and config
    assert manifest.bos_token_id == 1
    assert manifest.generation.temperature == 0.7
    assert sorted(manifest.files) == ["chat_template.jinja", "model.safetensors", "tokenizer.json"]
    config = manifest.config
    assert (config["hidden_size"], config["num_key_value_heads"], config["head_dim"]) == (64, 2, 16)
    assert config["rope_theta"] == 50000.0 and config["rope_scaling"] is None
    assert config["tie_word_embeddings"] is False and config["max_position_embeddings"] == 256
    source, exported = _weights(hf_dir), load_file(core / "model.safetensors")
    assert exported.keys() == source.keys()
    assert all(torch.equal(exported[name], source[name]) for name in source)
    assert "mark()" in (core / "chat_template.jinja").read_text()
    tokenizer = Tokenizer.from_file(str(core / "tokenizer.json"))
    assert tokenizer.encode("hello cat<|im_end|>").ids == _tokenizer().encode("hello cat<|im_end|>").ids


def test_a_decision_config_and_template_travel_with_the_core(hf_dir: Path, tmp_path: Path) -> None:
    source = tmp_path / "source"
    shutil.copytree(hf_dir, source)
    (source / "decision.json").write_text('{"labels": {"noul": ["yes", "no"]}}')
    (source / "decision_template.jinja").write_text("{{ state }}<|mark|>")
    core = tmp_path / "core"
    export(source, core)
    manifest = load_manifest(core, verify=True)
    assert {"decision.json", "decision_template.jinja"} <= manifest.files.keys()
    assert (core / "decision_template.jinja").read_text() == "{{ state }}<|mark|>"


def test_dtype_and_names_and_force(hf_dir: Path, tmp_path: Path) -> None:
    core = tmp_path / "core"
    core.mkdir()
    (core / "stale").write_text("old")
    export(hf_dir, core, ExportOptions(dtype="float32", served_names=("tiny", "org/tiny"), force=True))
    manifest = load_manifest(core, verify=True)
    assert manifest.served_names == ["tiny", "org/tiny"] and manifest.config["dtype"] == "float32"
    assert not (core / "stale").exists()
    assert load_file(core / "model.safetensors")["model.norm.weight"].dtype == torch.float32
    assert [p.name for p in tmp_path.iterdir()] == ["core"]


def test_gguf_exports_with_llama_cpp_permutation_undone(gguf_file: Path, hf_dir: Path, tmp_path: Path) -> None:
    core = tmp_path / "core"
    export(gguf_file, core)
    manifest = load_manifest(core, verify=True)
    assert manifest.dtype == "float32" and manifest.checkpoint == gguf_file.name
    assert manifest.served_names == ["tiny-llama-chat", "TinyOrg/Tiny-Llama-Chat"]
    assert 2 in manifest.eos_token_ids and manifest.bos_token_id == 1
    assert manifest.config["rope_theta"] == 50000.0 and manifest.config["num_attention_heads"] == 4
    source, exported = _weights(hf_dir), load_file(core / "model.safetensors")
    assert exported.keys() == source.keys()
    assert all(torch.equal(exported[name], source[name].float()) for name in source)
    assert "mark()" in (core / "chat_template.jinja").read_text()
    assert Tokenizer.from_file(str(core / "tokenizer.json")).encode("<|im_start|>hello").ids[0] == 1


def _assert_one_line_failure(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("ignition: error: ") and result.stderr.count("\n") == 1, result.stderr
    for needle in needles:
        assert needle in result.stderr


def test_unsupported_architecture(hf_dir: Path, tmp_path: Path) -> None:
    source = tmp_path / "gpt2"
    shutil.copytree(hf_dir, source)
    config = json.loads((source / "config.json").read_text()) | {"model_type": "gpt2"}
    (source / "config.json").write_text(json.dumps(config))
    result = _ignition("export", source, tmp_path / "core")
    _assert_one_line_failure(result, f"{source / 'config.json'}: unsupported architecture gpt2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2"]


def test_truncated_gguf(gguf_file: Path, tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(gguf_file.read_bytes()[: gguf_file.stat().st_size // 2])
    result = _ignition("export", truncated, tmp_path / "core")
    _assert_one_line_failure(result, f"{truncated}: not a readable GGUF file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["truncated.gguf"]


def test_corrupt_shard_leaves_nothing_behind(hf_dir: Path, tmp_path: Path) -> None:
    source = tmp_path / "source"
    shutil.copytree(hf_dir, source)
    shard = sorted(source.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:100])
    result = _ignition("export", source, tmp_path / "out" / "core")
    _assert_one_line_failure(result, f"{shard}: not a readable safetensors file")
    assert not (tmp_path / "out").exists()


def test_failure_midway_leaves_nothing_behind(hf_dir: Path, tmp_path: Path) -> None:
    source = tmp_path / "source"
    shutil.copytree(hf_dir, source)
    config = json.loads((source / "config.json").read_text()) | {"intermediate_size": 96}
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(CoreError, match=r"mlp.gate_proj.weight has shape \(128, 64\), the config says \(96, 64\)"):
        export(source, tmp_path / "out" / "core")
    assert list((tmp_path / "out").iterdir()) == []


def test_existing_out_needs_force(hf_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "core"
    out.mkdir()
    result = _ignition("export", hf_dir, out)
    _assert_one_line_failure(result, f"{out}: already exists")
    assert list(out.iterdir()) == []


def test_modified_weights_fail_verification(hf_dir: Path, tmp_path: Path) -> None:
    core = tmp_path / "core"
    export(hf_dir, core)
    with (core / "model.safetensors").open("r+b") as handle:
        handle.seek(-4, os.SEEK_END)
        handle.write(b"\x00\x01\x02\x03")
    with pytest.raises(CoreError, match="model.safetensors: SHA-256 mismatch"):
        load_manifest(core, verify=True)
    _assert_one_line_failure(_ignition("verify", core), f"{core / 'model.safetensors'}: SHA-256 mismatch")


def _smollm2_gguf() -> Path | None:
    path = Path(os.environ.get("FLARE_SMOLLM2_GGUF", REPO / ".cache" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    return path if path.is_file() else None


@pytest.mark.slow
@pytest.mark.skipif(_smollm2_gguf() is None, reason="no SmolLM2 GGUF (set FLARE_SMOLLM2_GGUF or fill .cache/)")
def test_smollm2_gguf_matches_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _smollm2_gguf()
    core = tmp_path / "smollm2"
    result = _ignition("export", path, core)
    assert result.returncode == 0, result.stderr
    manifest = load_manifest(core, verify=True)
    assert manifest.served_names[0] == "smollm2-135m-instruct"
    assert manifest.dtype == "float32" and manifest.context_limit == 8192
    assert (manifest.config["hidden_size"], manifest.config["num_hidden_layers"]) == (576, 30)
    assert manifest.config["tie_word_embeddings"] is True and manifest.config["rope_theta"] == 100000.0
    tokenizer = Tokenizer.from_file(str(core / "tokenizer.json"))
    assert tokenizer.token_to_id("<|im_end|>") in manifest.eos_token_ids
    assert "mark()" in (core / "chat_template.jinja").read_text()

    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in ["Hello, world!", "<|im_start|>user\nWhat is 2+2?<|im_end|>\n", "  naïve café 日本語 🙂\n\ttabs",
                 "def f(x):\n    return x ** 2  # 12345"]:
        assert tokenizer.encode(text).ids == reference(text).input_ids, text
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    # The core keeps the Q4_1 and Q8_0 blocks; dequantized, they are transformers' own fp32 weights, bit for bit.
    assert manifest.quantization == "q4,q8"
    expected, exported = model.state_dict(), load_file(core / "model.safetensors")
    dequantize_all(exported)
    assert exported.keys() == expected.keys() - {"lm_head.weight"}
    assert all(torch.equal(exported[name], expected[name]) for name in exported)


@pytest.mark.parametrize("quant", ["q8", "q4"])
def test_quant_export_of_a_dense_gguf_loads_and_runs_close_to_the_dense_core(gguf_file: Path, tmp_path: Path,
                                                                              quant: str) -> None:
    dense, quantized = tmp_path / "dense", tmp_path / quant
    assert _ignition("export", gguf_file, dense).returncode == 0
    result = _ignition("export", gguf_file, quantized, "--quant", quant)
    assert result.returncode == 0, result.stderr
    assert f"float32, {quant}" in result.stdout
    assert load_manifest(dense).quantization is None and load_manifest(quantized).quantization == quant
    ids = torch.tensor([1, 5, 9, 30])
    logits = []
    for core in (dense, quantized):
        model = load_model(core, torch.device("cpu"))[1]
        kv = torch.zeros(kv_cache_shape(model, 1, 64))
        meta = AttentionMetadata(torch.arange(4), torch.empty(0, dtype=torch.int64),
                                 torch.zeros(0, 1, dtype=torch.int64), torch.empty(0, dtype=torch.int64),
                                 (PrefillSpan(0, 4, 4, torch.tensor([0])),), 64)
        with torch.inference_mode():
            logits.append(model.logits(model(ids, torch.arange(4), kv, meta)))
    assert logits[0].shape == logits[1].shape
    # Round to nearest in groups of 32 moves each weight by half a step: 1/510 of its group's range at 8 bits,
    # 1/30 at 4; the tiny model's logits follow within a few times that.
    assert (logits[0] - logits[1]).abs().max() < (0.05 if quant == "q8" else 0.6) * logits[0].abs().max()


def test_quantized_core_refuses_tensor_parallelism(gguf_file: Path, tmp_path: Path) -> None:
    core = tmp_path / "q8"
    assert _ignition("export", gguf_file, core, "--quant", "q8").returncode == 0

    class TwoRanks:
        rank, world_size = 0, 2

    with pytest.raises(CoreError, match="runs on one rank"):
        load_model(core, torch.device("cpu"), tp=TwoRanks())
