"""A tiny random vision-language checkpoint built with transformers' own classes and saved as a Hugging Face directory
with its image processor (`Qwen2VLImageProcessorPil`), tokenizer and chat template; `ignition export` makes it a core.
The families: Qwen3-VL (Qwen3's text model, deepstack mergers, the Qwen2-VL template), Qwen3.5 (the hybrid text
model, Gated DeltaNet layers beside a gated attention layer with partial M-RoPE, the tower without deepstack, the
Qwen3.5 template) and Qwen3.5-MoE (Qwen3.5's, with mixture-of-experts MLPs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
           "<|video_pad|>"]
TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates" / "differential"
TEXTS = ["hello world, what is in the picture? a cat, a dog; red green blue. Describe both images."] * 20
MIN_PIXELS, MAX_PIXELS = 32 * 32 * 4, 32 * 32 * 64  # 4 to 64 image tokens: small prompts, every resize path
VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
              num_position_embeddings=64, patch_size=16)
TEXT = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=4096)
# family -> (config class, model class, text config, vision config, chat template)
FAMILIES = {
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration",
                 dict(TEXT, num_hidden_layers=3, head_dim=16,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                       "mrope_interleaved": True}),
                 dict(VISION, deepstack_visual_indexes=[0, 1]), "qwen2_vl.jinja"),
    # Three Gated DeltaNet layers to one gated attention layer that rotates half of each head (8 frequencies:
    # t, h, w interleaved 3/3/2, as Qwen3.5's 11/11/10 of 32).
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration",
                dict(TEXT, num_hidden_layers=4, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                     linear_key_head_dim=16, linear_value_head_dim=16,
                     layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2],
                                      "mrope_interleaved": True, "partial_rotary_factor": 0.5}),
                VISION, "qwen3_5.jinja"),
}
# Qwen3.5-MoE: Qwen3.5's layers, each MLP 8 routed experts (top 2) beside a gated shared expert.
FAMILIES["qwen3_5_moe"] = ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration",
                           dict(FAMILIES["qwen3_5"][2], num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                                shared_expert_intermediate_size=32), VISION, "qwen3_5.jinja")


def build(root: Path, seed: int = 0, family: str = "qwen3_vl"):  # noqa: ANN201 (transformers objects, imported lazily)
    """Save the checkpoint under `root`; returns (model, tokenizer, image processor)."""
    import transformers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config_class, model_class, text, vision, template = FAMILIES[family]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = (TEMPLATES / template).read_text()
    ids = {token: bpe.token_to_id(token) for token in SPECIAL}
    config = getattr(transformers, config_class)(
        text_config=dict(text, vocab_size=bpe.get_vocab_size()), vision_config=vision,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=ids["<|im_end|>"])
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    processor = Qwen2VLImageProcessorPil(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
                                         patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    model.save_pretrained(root)
    processor.save_pretrained(root)
    tokenizer.save_pretrained(root)
    return model, tokenizer, processor


def export(hf_dir: Path, core: Path) -> Path:
    ignition = Path(sys.executable).with_name("ignition")
    subprocess.run([str(ignition), "export", str(hf_dir), str(core), "--force"], check=True,
                   capture_output=True, text=True)
    return core
