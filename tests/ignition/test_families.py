"""`ignition` for the families beyond Llama: a GGUF written as llama.cpp's converter writes a Qwen3-MoE exports to
the same core as its Hugging Face directory; unsupported features are one-line errors naming them; every synth
preset is a config the engine reads. (Serving each family is tests/e2e/test_families.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from common.manifest import load_manifest
from engine.model.config import DecoderConfig
from ignition.export import export
from ignition.families import expected_shapes, normalised_config
from ignition.synth import CHAT_TEMPLATE, PRESETS, SPECIALS, SynthSource, byte_level_bpe

REPO = Path(__file__).resolve().parents[2]
MOE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
           num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=50000.0,
           tie_word_embeddings=False, bos_token_id=297, eos_token_id=299)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf") / "Tiny-Qwen3-MoE"
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**MOE)).save_pretrained(root)
    byte_level_bpe(MOE["vocab_size"]).save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": SPECIALS[1], "eos_token": SPECIALS[2], "chat_template": CHAT_TEMPLATE}))
    return root


def write_gguf_like_llama_cpp(hf_dir: Path, path: Path) -> None:
    """Qwen3-MoE as convert_hf_to_gguf.py writes it: llama.cpp names, each layer's experts stacked per kind, F32."""
    spec = json.loads((hf_dir / "tokenizer.json").read_text())["model"]
    tokens = sorted(spec["vocab"], key=spec["vocab"].get) + list(SPECIALS)
    writer = gguf.GGUFWriter(path, "qwen3moe")
    writer.add_block_count(MOE["num_hidden_layers"])
    writer.add_context_length(MOE["max_position_embeddings"])
    writer.add_embedding_length(MOE["hidden_size"])
    writer.add_feed_forward_length(MOE["intermediate_size"])
    writer.add_expert_feed_forward_length(MOE["moe_intermediate_size"])
    writer.add_expert_count(MOE["num_experts"])
    writer.add_expert_used_count(MOE["num_experts_per_tok"])
    writer.add_head_count(MOE["num_attention_heads"])
    writer.add_head_count_kv(MOE["num_key_value_heads"])
    writer.add_key_length(MOE["head_dim"])
    writer.add_value_length(MOE["head_dim"])
    writer.add_rope_freq_base(MOE["rope_theta"])
    writer.add_layer_norm_rms_eps(MOE["rms_norm_eps"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in SPECIALS else 1 for token in tokens])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in spec["merges"]])
    writer.add_bos_token_id(MOE["bos_token_id"])
    writer.add_eos_token_id(MOE["eos_token_id"])
    writer.add_chat_template(CHAT_TEMPLATE)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, MOE["num_hidden_layers"])
    weights = load_file(hf_dir / "model.safetensors")
    for layer in range(MOE["num_hidden_layers"]):
        for hf, short in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            stacked = torch.stack([weights.pop(f"model.layers.{layer}.mlp.experts.{e}.{hf}.weight")
                                   for e in range(MOE["num_experts"])])
            writer.add_tensor(f"blk.{layer}.ffn_{short}_exps.weight", stacked.numpy())
    for name, tensor in weights.items():
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)), tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_qwen3_moe_gguf_exports_to_the_core_of_its_hf_directory(moe_dir: Path, tmp_path: Path) -> None:
    gguf_path = tmp_path / "Tiny-Qwen3-MoE.F32.gguf"
    write_gguf_like_llama_cpp(moe_dir, gguf_path)
    export(moe_dir, tmp_path / "from-hf")
    export(gguf_path, tmp_path / "from-gguf")
    hf, gg = load_manifest(tmp_path / "from-hf", verify=True), load_manifest(tmp_path / "from-gguf", verify=True)
    assert hf.architecture == gg.architecture == "qwen3_moe"
    from_gguf, from_hf = DecoderConfig.from_hf("qwen3_moe", gg.config), DecoderConfig.from_hf("qwen3_moe", hf.config)
    assert from_gguf.rms_norm_eps == pytest.approx(from_hf.rms_norm_eps)  # GGUF stores it as a float32
    assert replace(from_gguf, rms_norm_eps=from_hf.rms_norm_eps) == from_hf
    hf_weights = load_file(tmp_path / "from-hf" / "model.safetensors")
    gguf_weights = load_file(tmp_path / "from-gguf" / "model.safetensors")
    assert hf_weights.keys() == gguf_weights.keys()
    assert hf_weights["model.layers.1.mlp.w13"].shape == (8, 64, 64)
    for name, tensor in hf_weights.items():
        assert torch.equal(tensor, gguf_weights[name]), name


@pytest.mark.parametrize("change, named", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}}, "yarn"),
    ({"hidden_act": "gelu"}, "hidden_act=gelu"),
    ({"model_type": "qwen2_moe"}, "unsupported architecture qwen2_moe"),
])
def test_an_unsupported_feature_is_a_one_line_error_naming_it(moe_dir: Path, tmp_path: Path, change: dict,
                                                               named: str) -> None:
    config = json.loads((moe_dir / "config.json").read_text())
    (moe_dir.parent / "bad").mkdir(exist_ok=True)
    bad = moe_dir.parent / "bad" / change.get("model_type", "x")
    if bad.exists():
        subprocess.run(["rm", "-r", str(bad)], check=True)
    subprocess.run(["cp", "-r", str(moe_dir), str(bad)], check=True)
    (bad / "config.json").write_text(json.dumps({**config, **change}))
    result = subprocess.run([sys.executable, "-m", "ignition.main", "export", str(bad), str(tmp_path / "core")],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and named in result.stderr, result.stderr
    assert not (tmp_path / "core").exists()


def test_gemma_softcapping_is_refused_at_export() -> None:
    raw = {**PRESETS["gemma-3-12b"], "num_hidden_layers": 2, "final_logit_softcapping": 30.0}
    with pytest.raises(Exception, match="final_logit_softcapping=30.0"):
        normalised_config(raw, Path("config.json"), "bfloat16", "x")


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_synth_preset_is_a_config_the_engine_reads(preset: str) -> None:
    source = SynthSource(preset, 6, "bfloat16", 0)
    family, config = normalised_config(source.config(), source.path, "bfloat16", "synthetic")
    model = DecoderConfig.from_hf(family, config)
    assert model.num_layers == 6 and len(expected_shapes(family, config)) == source.tensor_count()
    if preset == "gemma-3-12b":
        assert model.layer_window == (1024,) * 5 + (None,) and len(model.ropes) == 2
    if preset == "qwen3-30b-a3b":
        assert (model.num_experts, model.num_experts_per_tok, model.norm_topk_prob) == (128, 8, True)
    if preset in ("qwen3.5-9b", "qwen3-next-80b-a3b"):  # --layers keeps three linear layers to each full one
        assert model.layer_linear == (True, True, True, False, True, True) and model.rotated_dim == 64
    if preset == "qwen3-next-80b-a3b":
        assert (model.num_experts, model.num_experts_per_tok, model.shared_expert_intermediate_size) == (512, 10, 512)


def test_a_multimodal_gemma3_exports_its_text_model(tmp_path: Path) -> None:
    """Gemma3ForConditionalGeneration's text model, served: its logits on a text prompt longer than the window."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    from engine.model.attention import AttentionMetadata, PrefillSpan
    from engine.model.loader import load_model

    text = Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
                            layer_types=["sliding_attention", "full_attention"])
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    torch.manual_seed(0)
    reference = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision,
                                                            mm_tokens_per_image=4, image_token_index=290)).eval()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.normal_(0, 0.05) if p.dim() > 1 else p.add_(torch.randn_like(p), alpha=0.5)
    hf_dir = tmp_path / "Tiny-Gemma-3"
    reference.save_pretrained(hf_dir)
    byte_level_bpe(300).save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    export(hf_dir, tmp_path / "core")
    manifest, model = load_model(tmp_path / "core", torch.device("cpu"))
    assert manifest.architecture == "gemma3_text" and model.config.layer_window == (16, None)
    ids = torch.randint(0, 280, (40,), generator=torch.Generator().manual_seed(1))
    kv = torch.zeros(2, 2, 64, 2, 16)
    none = torch.zeros(0, dtype=torch.long)
    meta = AttentionMetadata(torch.arange(40), none, none.view(0, 1), none, (PrefillSpan(0, 40, 40, torch.tensor([0])),),
                             64)
    with torch.no_grad():
        ours = model.logits(model(ids, torch.arange(40), kv, meta))
        theirs = reference(input_ids=ids[None]).logits[0]
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_a_multimodal_qwen3_5_moe_exports_its_tower_and_answers_an_image_with_transformers_tokens(
        tmp_path: Path, device: str) -> None:
    """Qwen3_5MoeForConditionalGeneration (experts saved one by one, a shared expert, Qwen3.5's tower without
    deepstack): the core holds the tower and the image processor's settings, and the engine (the real scheduler and
    eager executor, chunked prefill) gives transformers' greedy tokens for a prompt holding an image; on a GPU too,
    where a hybrid runs its tower and text model eagerly in the torch reference (transformers on the CPU)."""
    from common.mrope import mrope_delta
    from common.protocol import ImageInput, SamplingParams
    from engine.model.loader import load_model
    from engine.model.qwen3_vl import VisionLanguageLM
    from engine.scheduler.request import Request
    from frontend.images.decode import ImageLimits
    from frontend.images.prepare import prepare
    from tests.support.engine_harness import Harness
    from tests.support.image_samples import encode, picture
    from tests.support.vision_checkpoint import build

    reference, _, _ = build(tmp_path / "hf", family="qwen3_5_moe")
    export(tmp_path / "hf", tmp_path / "core")
    manifest, model = load_model(tmp_path / "core", torch.device(device))
    settings = manifest.vision
    assert manifest.architecture == "qwen3_5_moe" and settings.image_token_id == reference.config.image_token_id
    assert isinstance(model, VisionLanguageLM) and model.config.num_experts == 8
    assert not model.visual.deepstack_merger_list
    image = prepare(encode(picture(90, 60), "PNG"), settings, ImageLimits(), "image")
    prompt = [10, 11, settings.vision_start_token_id] + [settings.image_token_id] * image.tokens + \
        [settings.vision_end_token_id] + list(range(20, 60))  # past the first prefill chunk
    wire = ImageInput(image.identity, 3, list(image.grid), image.patches.tobytes())
    span = (3, 3 + image.tokens, mrope_delta([(3, image.grid)], settings.merge_size))
    request = Request("r", b"t", len(prompt), list(prompt), SamplingParams(temperature=0.0, max_tokens=8), 0,
                      frozenset(), 8, 0.0, images=(wire,), image_spans=(span,))
    harness = Harness(model, chunk=32, device=device)
    harness.scheduler.add(request)
    harness.run()
    harness.close()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        expected = reference.generate(input_ids=ids, pixel_values=torch.from_numpy(image.patches),
                                      image_grid_thw=torch.tensor([image.grid]), max_new_tokens=8, do_sample=False,
                                      mm_token_type_ids=(ids == settings.image_token_id).int())
    assert request.tokens[len(prompt):] == expected[0, len(prompt):].tolist()
