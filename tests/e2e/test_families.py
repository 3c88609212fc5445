"""Every model family against transformers, end to end: a tiny random checkpoint built with transformers' own class
and saved with `save_pretrained`, exported with `ignition export`, served with `flare run`; greedy tokens over the
HTTP API (the real openai client) equal transformers' `generate` on the same prompt ids (fp32, CPU).

The cores take small pages and prefill chunks, so that prompts span several chunks and pages; Gemma 3's window is
smaller than the prompts (a global layer between two sliding ones), and the MoE models route 8 experts top-2
(Qwen3-MoE with one dense layer among the sparse ones).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import openai
import pytest
import torch
import transformers

from common.manifest import Capacities, load_manifest, write_manifest
from ignition.main import main as ignition
from ignition.synth import CHAT_TEMPLATE, SPECIALS, byte_level_bpe
from tests.support.servers import Server

NEW_TOKENS = 20
WINDOW = 24
CAPACITIES = Capacities(max_active=8, page_size=16, prefill_chunk_size=32, kv_cache_bytes=1 << 23)
BASE = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
        "bos_token_id": 509, "eos_token_id": 511, "pad_token_id": 0}
# Family -> (transformers' config class, its model class, what the family adds to BASE).
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32, "tie_word_embeddings": False}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "norm_topk_prob": True,
                   "mlp_only_layers": [1], "tie_word_embeddings": False}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 8, "num_experts_per_tok": 2}),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                    {"head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": WINDOW,
                     "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                     "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                            "rope_theta": 100_000.0},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}}),
}
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex every jovial bystander".split()


def text(words: int, offset: int = 0) -> str:
    return " ".join(WORDS[(offset + i) % len(WORDS)] for i in range(words))


CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "user", "content": text(12, 3)}],
    [{"role": "system", "content": text(20, 1)}, {"role": "user", "content": text(40, 5)}],  # several chunks
    [{"role": "user", "content": text(70, 2)}],
]


def build_checkpoint(family: str, root: Path, families: dict = FAMILIES) -> Path:
    """`families`: FAMILIES, or another table of (config class, model class, what it adds to BASE)."""
    config_class, model_class, extra = families[family]
    config = getattr(transformers, config_class)(**{**BASE, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    # Larger weights than the default init, and norm weights off their init, so that outputs vary from token to
    # token; Gemma's embeddings, scaled by sqrt(hidden) and tied to the head, take smaller ones.
    std = 0.05 if family == "gemma3_text" else 0.5
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 or name.endswith("bias"):
                p.normal_(0, std)
            else:
                p.add_(torch.randn_like(p), alpha=0.5)
    hf_dir = root / f"tiny-{family}"
    model.save_pretrained(hf_dir)
    byte_level_bpe(BASE["vocab_size"]).save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": SPECIALS[1], "eos_token": SPECIALS[2], "chat_template": CHAT_TEMPLATE}))
    return hf_dir


def served_checkpoint(family: str, root: Path, families: dict = FAMILIES,
                      server_args: tuple[str, ...] = ()) -> tuple[Server, torch.nn.Module]:
    """A server (`flare run` with `server_args`) of the family's tiny checkpoint as `ignition export` makes its core,
    and transformers' model of the same checkpoint."""
    hf_dir = build_checkpoint(family, root, families)
    core = root / "core"
    assert ignition(["export", str(hf_dir), str(core)]) == 0
    manifest = load_manifest(core)
    assert manifest.architecture == family
    write_manifest(core, msgspec.structs.replace(manifest, capacities=CAPACITIES))
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    reference.generation_config.eos_token_id = None  # like ignore_eos: always NEW_TOKENS tokens
    return Server(core, *server_args), reference


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(family, a server of the exported core, transformers' model of the same checkpoint)."""
    server, reference = served_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    yield request.param, server, reference
    server.stop()


def hf_generate(model: torch.nn.Module, prompt_ids: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():  # an explicit mask: otherwise generate masks out every prompt token equal to the pad id
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def chat(server: Server, messages: list[dict], max_tokens: int = NEW_TOKENS):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    return client.chat.completions.create(model=client.models.list().data[0].id, messages=messages, temperature=0,
                                          max_tokens=max_tokens,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})


def ids_of(response) -> tuple[list[int], list[int]]:  # noqa: ANN001 (the openai client's response type)
    return response.model_extra["prompt_token_ids"], response.choices[0].model_extra["token_ids"]


def check_conversations_at_once(name: str, server: Server, reference: torch.nn.Module) -> None:
    """CONVERSATIONS all in flight at once: each one's greedy tokens equal transformers' for its prompt ids, and the
    longest prompt spans more than two prefill chunks and two of Gemma's windows."""
    with ThreadPoolExecutor(len(CONVERSATIONS)) as pool:
        results = [ids_of(r) for r in pool.map(lambda m: chat(server, m), CONVERSATIONS)]
    assert len({token for _, tokens in results for token in tokens}) > 10, "degenerate outputs would test little"
    lengths = [len(prompt) for prompt, _ in results]
    assert max(lengths) > 2 * CAPACITIES.prefill_chunk_size and max(lengths) > 2 * WINDOW
    for (prompt, tokens), messages in zip(results, CONVERSATIONS):
        assert tokens == hf_generate(reference, prompt), (name, messages)


def test_greedy_tokens_equal_transformers_generate_under_concurrency(family) -> None:
    check_conversations_at_once(*family)


def test_a_second_turn_reuses_the_prefix_cache_and_keeps_the_tokens(family) -> None:
    name, server, reference = family
    first = [{"role": "user", "content": text(30, 7)}]  # longer than the window: reuse must respect it
    reply = chat(server, first, max_tokens=8)
    first_prompt, first_tokens = ids_of(reply)
    assert first_tokens == hf_generate(reference, first_prompt, 8)
    second = first + [{"role": "assistant", "content": reply.choices[0].message.content},
                      {"role": "user", "content": text(10, 1)}]
    response = chat(server, second)
    assert response.usage.prompt_tokens_details.cached_tokens > WINDOW
    prompt, tokens = ids_of(response)
    assert tokens == hf_generate(reference, prompt), name
