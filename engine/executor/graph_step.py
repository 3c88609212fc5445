"""The device side of a graph step: the static buffers every captured graph reads and writes, and the two
functions captured per capacity (the model up to the logits, and sampling). Nothing here is CUDA-specific, so the
CPU tests run the same functions eagerly under the Triton interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.executor.frames import Layout, device_views
from engine.kernels.triton.page_table import apply_patches
from engine.kernels.triton.state_copy import copy_state_rows
from engine.model.attention import DecodeBatch, ExtendBatch, KernelMetadata
from engine.model.decoder import CausalLM
from engine.model.recurrent_state import RecurrentBatch, RecurrentState
from engine.sampling.graph_extras import ExtrasBuffers, extras_sample_step
from engine.sampling.sampler import SamplingTensors, apply_token_mask, sample
from engine.speculative.verify import accept


@dataclass(frozen=True)
class StaticBuffers:
    frame: torch.Tensor  # int32 [words]: the current step's inputs (engine/executor/frames.py)
    page_tables: torch.Tensor  # int32 [slots + 1, width]: one row per request slot, the last for padding rows
    slot_tokens: torch.Tensor  # int64 [slots + 1]: each slot's last sampled token; the last entry is padding's
    logits: torch.Tensor  # float32 [max_seqs, vocab]
    sampled: torch.Tensor  # int64 [max_seqs]: the step's tokens, one per sequence row
    masks: torch.Tensor  # int32 [max_seqs, ceil(vocab / 32)]: grammar masks of a constrained step (engine/sampling/grammar.py)

    @classmethod
    def allocate(cls, words: int, slots: int, width: int, max_seqs: int, vocab: int,
                 device: torch.device) -> StaticBuffers:
        return cls(torch.zeros(words, dtype=torch.int32, device=device),
                   torch.zeros(slots + 1, width, dtype=torch.int32, device=device),
                   torch.zeros(slots + 1, dtype=torch.int64, device=device),
                   torch.zeros(max_seqs, vocab, dtype=torch.float32, device=device),
                   torch.zeros(max_seqs, dtype=torch.int64, device=device),
                   torch.full((max_seqs, (vocab + 31) // 32), -1, dtype=torch.int32, device=device))


def step_metadata(views: dict[str, torch.Tensor], layout: Layout, page_tables: torch.Tensor,
                  page_size: int, state: RecurrentState | None = None) -> KernelMetadata:
    """`state`: a hybrid model's, whose row each sequence continues is its slot's (a padding row's, the padding
    slot's, touched by nothing: its decode row has no context, its extend sequence no tokens)."""
    if layout.kind == "decode":
        recurrent = None if state is None else RecurrentBatch(state, views["slot"], views["context_len"] - 1)
        return KernelMetadata(views["slot_mapping"], page_size,
                              decode=DecodeBatch(page_tables, views["slot"], views["context_len"]),
                              recurrent=recurrent)
    recurrent = None if state is None else \
        RecurrentBatch(state, views["slot"], views["context_len"] - views["query_len"])
    return KernelMetadata(views["slot_mapping"], page_size, extend=ExtendBatch(
        page_tables, views["slot"], views["query_start"], views["query_len"], views["context_len"],
        views["block_seq"], views["block_first"]), recurrent=recurrent)


@torch.inference_mode()
def model_step(model: CausalLM, kv_cache: torch.Tensor, buffers: StaticBuffers, layout: Layout,
               page_size: int, hidden_out: torch.Tensor | None = None, state: RecurrentState | None = None) -> None:
    """Apply the frame's page-table patches (and a hybrid model's state row copies to its `state`), run the model,
    leave the sequences' logits in buffers.logits (and every token's final hidden state in `hidden_out`, for prompt
    logprobs: engine/sampling/graph_extras.py)."""
    views = device_views(buffers.frame, layout)
    apply_patches(buffers.page_tables, buffers.frame[layout.patches:], buffers.frame[:1])
    if state is not None and layout.state_copies:
        copies = views["state_copy"]
        copy_state_rows((state.conv, state.delta), copies[1:].view(-1, 2), copies[:1])
    ids = torch.where(views["token"] >= 0, views["token"], buffers.slot_tokens[views["token_slot"]])
    meta = step_metadata(views, layout, buffers.page_tables, page_size, state)
    hidden = model(ids, views["position"], kv_cache, meta)
    if hidden_out is not None:
        hidden_out[:layout.tokens] = hidden
    buffers.logits[:layout.seqs] = model.logits(hidden[views["sample_row"]])


def draw(views: dict[str, torch.Tensor], logits: torch.Tensor, greedy: bool) -> torch.Tensor:
    """One token per row: argmax, or the explicit (seed, position) hash of engine/sampling/sampler.py."""
    if greedy:
        return logits.argmax(dim=-1)
    zeros = torch.zeros_like(views["temperature"])
    return sample(logits, SamplingTensors(
        temperature=views["temperature"], top_p=views["top_p"], top_k=views["top_k"].long(),
        min_p=views["min_p"], seed=views["seed"], position=views["output_index"].long(),
        presence_penalty=zeros, frequency_penalty=zeros, repetition_penalty=zeros + 1,
        all_greedy=False, any_penalty=False))


@torch.inference_mode()
def sample_step(buffers: StaticBuffers, layout: Layout, greedy: bool, masked: bool = False,
                extras: ExtrasBuffers | None = None) -> None:
    """Draw one token per sequence row into buffers.sampled, and into slot_tokens for rows that sample (others
    write the padding entry).
    `masked`: the rows' grammar masks, uploaded into buffers.masks before the launch, are applied first.
    `extras`: penalties, bans and logprobs around the draw (engine/sampling/graph_extras.py); the masks are
    applied too, so a step without grammar masks sets them to allow everything."""
    views = device_views(buffers.frame, layout)
    seqs = layout.seqs
    logits = buffers.logits[:seqs]
    if extras is not None:
        tokens = extras_sample_step(logits, buffers.masks[:seqs], views, extras, seqs,
                                    lambda processed: draw(views, processed, greedy))
    else:
        tokens = draw(views, apply_token_mask(logits, buffers.masks[:seqs]) if masked else logits, greedy)
    buffers.sampled[:seqs] = tokens
    buffers.slot_tokens[views["sample_slot"].long()] = tokens


@torch.inference_mode()
def accept_drafts(buffers: StaticBuffers, layout: Layout, spans: torch.Tensor, max_width: int) -> torch.Tensor:
    """After a verify step's sampling (rows from frames.verify_rows): each verify row's accepted drafts and the
    token after them (int64 [2, R]), that token written as its slot's next input. `spans`: frames.verify_spans."""
    first, width, slot = spans
    columns = torch.arange(max_width, device=spans.device)
    index = first[:, None] + torch.minimum(columns[None, :], width[:, None] - 1)
    drafts = device_views(buffers.frame, layout)["token"][index[:, 1:]].long()  # position i's token is draft i
    accepted, final = accept(buffers.sampled[index], drafts, width)
    buffers.slot_tokens[slot] = final
    return torch.stack([accepted, final])
