"""Tensor parallelism on the CPU (gloo): sharding rules, greedy tokens over 2 and 3 ranks equal a single rank's (a tiny
random core through flare-engine processes and the wire; SmolLM2 through `flare run --tp R` and the openai client),
and rank failure (a rank killed mid-stream or while idle: clients get an error, the other ranks exit, `flare run`
names the rank). On two GPUs: the ranks' captured graphs (NCCL inside them) give one rank's tokens."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
import torch
import zmq

from common import protocol as wire
from common.errors import CoreError
from common.links import LinkKeys, write_keys
from common.ranks import GROUP_FAILED, engine_commands
from engine.model.config import HYBRIDS, DecoderConfig
from engine.model.loader import load_model
from engine.model.sharding import Shard, supported_world_sizes
from engine.parallel.worker import check_plan
from engine.scheduler.plan import Plan, Row
from tests.support.servers import Server
from tests.support.engine_harness import FAMILY_CONFIGS, Harness
from tests.support.fp8_checkpoints import as_fp8
from tests.support.tiny_cores import TINY, write_tiny_core

PROMPTS = [[5, 6, 7], list(range(10, 60)), list(range(100, 190)), [42]]
NEW_TOKENS = 12
CHATS = [[{"role": "user", "content": "Name the planets of the solar system."}],
         [{"role": "user", "content": "Write a haiku about the sea."}]]


def config(heads: int, kv_heads: int) -> DecoderConfig:
    return DecoderConfig.from_hf("llama", {**TINY, "num_attention_heads": heads, "num_key_value_heads": kv_heads})


# --- sharding rules ---------------------------------------------------------------------------------------------

def test_supported_world_sizes_follow_the_kv_groups() -> None:
    assert supported_world_sizes(9, 3) == [1, 2, 3, 9]  # SmolLM2-135M
    assert supported_world_sizes(6, 3) == [1, 2, 3, 6]
    assert supported_world_sizes(32, 8) == [1, 2, 3, 4, 5, 6, 7, 8, 16, 32]  # Llama 3 8B


def test_an_unsupported_world_size_is_a_one_line_error() -> None:
    with pytest.raises(CoreError) as caught:
        Shard.of(config(9, 3), 0, 4)
    assert "\n" not in str(caught.value) and "supported world sizes: 1, 2, 3, 9" in str(caught.value)


@pytest.mark.parametrize("heads, kv_heads, world", [(9, 3, 2), (9, 3, 3), (9, 3, 9), (6, 1, 3), (6, 3, 2)])
def test_every_query_head_sits_on_a_rank_of_its_kv_head(heads: int, kv_heads: int, world: int) -> None:
    shards = [Shard.of(config(heads, kv_heads), rank, world) for rank in range(world)]
    assert [h for s in shards for h in s.heads] == list(range(heads))
    assert [c for s in shards for c in s.intermediate] == list(range(TINY["intermediate_size"]))
    assert [v for s in shards for v in s.vocab] == list(range(TINY["vocab_size"]))
    group = heads // kv_heads
    for shard in shards:
        assert all(h // group in shard.kv_heads for h in shard.heads)
        assert len(shard.heads) == len(shard.kv_heads) * group or len(shard.kv_heads) == 1


def test_a_rank_refuses_a_step_it_cannot_run() -> None:
    row = Row(slot=1, generation=1, start=0, length=3, tokens=(1, 2, 3), page_table=(7,), sample=True,
              output_index=0, sampling=wire.SamplingParams(), seed=0, prompt_len=3)
    assert check_plan(Plan((row,)), num_pages=8, page_size=16, max_active=4, vocab_size=320) is None
    assert "page" in check_plan(Plan((row,)), num_pages=4, page_size=16, max_active=4, vocab_size=320)
    assert "slot" in check_plan(Plan((row,)), num_pages=8, page_size=16, max_active=1, vocab_size=320)
    assert "vocabulary" in check_plan(Plan((row,)), num_pages=8, page_size=16, max_active=4, vocab_size=2)
    spill = Plan((row,), spills=((7, 0),), state_spills=((5, 1),))  # a hybrid's snapshot row 5 to host row 1
    assert check_plan(spill, 8, 16, 4, 320, host_slots=1, state_rows=6, host_snapshots=2) is None
    assert "snapshot row" in check_plan(spill, 8, 16, 4, 320, host_slots=1, state_rows=6, host_snapshots=1)
    assert "state row" in check_plan(spill, 8, 16, 4, 320, host_slots=1, state_rows=5, host_snapshots=2)


# --- a tiny random core over flare-engine processes -------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_core(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_core(tmp_path_factory.mktemp("tiny-core"), "llama")


def single_rank_tokens(core: Path, prompts: list[list[int]], page_size: int, chunk: int) -> list[list[int]]:
    """Greedy tokens of one rank: the same scheduler and executor in this process."""
    _, model = load_model(core, torch.device("cpu"))
    harness = Harness(model, num_pages=64, page_size=page_size, chunk=chunk)
    requests = [harness.add(p, temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True) for p in prompts]
    harness.run()
    harness.close()
    return [r.tokens[len(p):] for p, r in zip(prompts, requests)]


def start_ranks(core: Path, world: int, address: str, logs: Path, device: str = "cpu",
                extra: list[str] = ()) -> list[subprocess.Popen]:
    """The engine ranks as `flare run --tp` starts them, logging to files."""
    return [subprocess.Popen([sys.executable, "-m", *command], stdout=(logs / f"rank{rank}.log").open("w"),
                             stderr=subprocess.STDOUT, start_new_session=True)
            for rank, command in enumerate(engine_commands(core, address, world, ["--device", device, *extra]))]


class WireClient:
    """A frontend's side of the wire, bare: submit token ids, collect each request's tokens and its end."""

    def __init__(self, address: str, keys: LinkKeys | None = None) -> None:
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, uuid.uuid4().hex.encode())
        self.socket.setsockopt(zmq.LINGER, 0)
        if keys:
            keys.join(self.socket)
        self.socket.connect(address)
        self.socket.send(wire.encode(wire.Hello(wire.PROTOCOL_VERSION, "test")))
        assert self.socket.poll(60_000), "no Welcome from rank 0"
        assert isinstance(wire.decode_engine_message(self.socket.recv()), wire.Welcome)

    def generate(self, prompts: list[list[int]], **sampling: object) -> dict[str, tuple[list[int], str, str | None]]:
        for i, prompt in enumerate(prompts):
            params = wire.SamplingParams(**{"temperature": 0.0, "max_tokens": NEW_TOKENS, "ignore_eos": True,
                                            **sampling})
            self.socket.send(wire.encode(wire.Submit(f"r{i}", prompt, params)))
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        ends: dict[str, tuple[str, str | None]] = {}
        self.cached = dict.fromkeys(tokens, 0)  # each request's prompt tokens read from the prefix cache
        while len(ends) < len(prompts):
            assert self.socket.poll(60_000), "rank 0 went quiet"
            message = wire.decode_engine_message(self.socket.recv())
            if isinstance(message, wire.Outputs):
                for rid, new, reason, error, cached in zip(message.request_ids, message.token_ids,
                                                           message.finish_reasons, message.errors,
                                                           message.cached_tokens):
                    tokens[rid] += new
                    self.cached[rid] = max(self.cached[rid], cached)
                    if reason:
                        ends[rid] = (reason, error)
        return {rid: (tokens[rid], *ends[rid]) for rid in tokens}

    def close(self) -> None:
        self.socket.close()


def exit_statuses(ranks: list[subprocess.Popen], timeout: float) -> list[int | None]:
    for rank in ranks:
        try:
            rank.wait(timeout)
        except subprocess.TimeoutExpired:
            rank.kill()
    return [rank.returncode for rank in ranks]


@contextmanager
def serving_ranks(core: Path, world: int, address: str, logs: Path, extra: list[str] = ()) -> Iterator[WireClient]:
    """The ranks started, a client on rank 0; after the block the client leaves and SIGTERM to rank 0 stops the
    group cleanly (rank 0 drains, then stops the others)."""
    ranks = start_ranks(core, world, address, logs, extra=extra)
    try:
        client = WireClient(address)
        yield client
        client.close()
        ranks[0].send_signal(signal.SIGTERM)
        assert exit_statuses(ranks, 30) == [0] * world
    finally:
        exit_statuses(ranks, 0.1)


def listening_hosts(port: int) -> set[str]:
    """The local addresses with a TCP socket listening on `port` (hex, as /proc/net/tcp and tcp6 write them)."""
    hosts = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            host, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:
                hosts.add(host)
    return hosts


@pytest.mark.slow
def test_tiny_core_over_two_ranks_then_a_clean_stop(tiny_core: Path, tmp_path: Path) -> None:
    """With link keys: the step channel and the request socket run CURVE, and the rendezvous listens on loopback."""
    expected = single_rank_tokens(tiny_core, PROMPTS, page_size=16, chunk=48)
    address = f"ipc://{tmp_path}/engine.sock"
    write_keys(tmp_path / "keys")
    ranks = start_ranks(tiny_core, 2, address, tmp_path, extra=["--engine-keys", str(tmp_path / "keys")])
    rendezvous = int(ranks[0].args[ranks[0].args.index("--dist-address") + 1].rsplit(":", 1)[1])
    try:
        client = WireClient(address, LinkKeys.load(tmp_path / "keys"))
        assert listening_hosts(rendezvous) == {"0100007F"}  # 127.0.0.1 alone
        # Logprobs and prompt logprobs take the gathered logits on other rows: every rank must run that too.
        got = client.generate(PROMPTS, logprobs=2, prompt_logprobs=1)
        assert [got[f"r{i}"] for i in range(len(PROMPTS))] == [(t, "length", None) for t in expected]
        # Sampled with penalties: rank 0 would fail the requests if any rank drew other tokens than its own.
        sampled = client.generate(PROMPTS, temperature=1.0, top_p=0.9, seed=5, presence_penalty=0.5)
        assert all(len(tokens) == NEW_TOKENS and (reason, error) == ("length", None)
                   for tokens, reason, error in sampled.values())
        client.close()
        ranks[0].send_signal(signal.SIGTERM)  # rank 0 drains, then stops rank 1
        assert exit_statuses(ranks, 30) == [0, 0]
    finally:
        exit_statuses(ranks, 0.1)


@pytest.mark.slow
def test_two_ranks_restore_an_evicted_conversation_from_their_host_tiers(tiny_core: Path, tmp_path: Path) -> None:
    """Each rank spills and restores its shard of the pages. The KV heads split 2 + 1, so the ranks' budgets hold
    different page counts: all use the fewest (6 KV pages, 16 host pages)."""
    page_bytes = 2 * 2 * 16 * 2 * 16 * 4  # rank 0's page: layers, K and V, tokens, its 2 KV heads, head size, fp32
    address = f"ipc://{tmp_path}/engine.sock"
    with serving_ranks(tiny_core, 2, address, tmp_path, ["--kv-cache-bytes", str(6 * page_bytes),
                                                         "--host-cache-bytes", str(16 * page_bytes)]) as client:
        first = list(range(10, 60))
        reply = client.generate([first])["r0"][0]
        for other in (list(range(100, 150)), list(range(150, 200)), list(range(200, 250))):
            client.generate([other])  # 4 pages each: the first conversation's pages leave the device
        second = first + reply + [7, 8, 9]
        got = client.generate([second])["r0"]
        assert client.cached["r0"] >= 48  # its whole pages, from the host tiers
        assert got == (single_rank_tokens(tiny_core, [second], page_size=16, chunk=48)[0], "length", None)
    assert "host tier: 16 pages" in (tmp_path / "rank0.log").read_text()


@pytest.mark.slow
def test_two_ranks_read_a_conversation_back_from_their_disk_tiers_after_a_restart(tiny_core: Path,
                                                                                   tmp_path: Path) -> None:
    """Each rank writes its shard of every page to its own directory; after a restart of the group a second turn
    reads them back on both ranks. A file that one rank cannot read is refused by all: the turn is computed again
    with the same tokens, and the ranks delete their files of it (a clean stop writes them again)."""
    page_bytes = 2 * 2 * 16 * 2 * 16 * 4  # rank 0's page (as above)
    address = f"ipc://{tmp_path}/engine.sock"
    extra = ["--kv-cache-bytes", str(6 * page_bytes), "--host-cache-bytes", str(6 * page_bytes),
             "--disk-cache", str(tmp_path)]
    conversations = [list(range(10, 60)), list(range(60, 110))]
    with serving_ranks(tiny_core, 2, address, tmp_path, extra) as client:
        replies = [client.generate([first])["r0"][0] for first in conversations]
        for other in (list(range(100, 150)), list(range(150, 200)), list(range(200, 250)), list(range(250, 300))):
            client.generate([other])  # 4 pages each through 6 on the device and 6 on the host: the first two go
    files = {rank: tmp_path / f"rank{rank}-of-2" for rank in (0, 1)}
    assert all(len(list(files[rank].glob("*.kv"))) >= 6 for rank in (0, 1))
    seconds = [first + reply + [7, 8, 9] for first, reply in zip(conversations, replies)]
    expected = single_rank_tokens(tiny_core, seconds, page_size=16, chunk=48)
    with serving_ranks(tiny_core, 2, address, tmp_path, extra) as client:
        assert client.generate([seconds[0]])["r0"] == (expected[0], "length", None)
        assert client.cached["r0"] >= 48  # its whole pages, read from both ranks' disk tiers
        for path in files[1].glob("*.kv"):  # rank 1's shard of the other conversation turns unreadable
            path.write_bytes(path.read_bytes()[:-1])
        unreadable = {path.name for path in files[1].glob("*.kv")}
        assert client.generate([seconds[1]])["r0"] == (expected[1], "length", None)
        assert client.cached["r0"] == 0
        refused = unreadable - {path.name for path in files[1].glob("*.kv")}
        assert len(refused) >= 3  # its three blocks' files, gone from both ranks' directories
        assert not refused & {path.name for path in files[0].glob("*.kv")}
    assert "skipping" in (tmp_path / "rank1.log").read_text()


@pytest.mark.slow
def test_two_ranks_restore_an_evicted_hybrid_conversation_with_its_snapshot(tmp_path: Path) -> None:
    """A hybrid's exact checkpoint evicted from two snapshot rows: each rank spills and restores its shard of the
    pages and of the snapshot (its heads' recurrent state), and the next turn continues from there. The clean stop
    writes what the tiers hold to each rank's disk directory, snapshots included, and after a restart the turn
    after continues from its files."""
    core = write_tiny_core(tmp_path, "qwen3_5")
    row_bytes = 3 * (64 * 3 + 2 * 16 * 16) * 4  # a rank's state row: 3 linear layers of 1 key head, 2 value heads
    page_bytes = 2 * 16 * 2 * 32 * 4  # rank 0's page: 1 attention layer, K and V, tokens, 2 KV heads of 32, fp32
    # Per rank: 2 snapshot rows and 2 slots' rows, 8 pages (rank 0's; rank 1's half pages are 16); on the host 8
    # snapshot rows (a quarter) and pages of the rest.
    address = f"ipc://{tmp_path}/engine.sock"
    extra = ["--max-active", "2", "--kv-cache-bytes", str(4 * row_bytes + 8 * page_bytes),
             "--host-cache-bytes", str(32 * row_bytes), "--disk-cache", str(tmp_path)]
    with serving_ranks(core, 2, address, tmp_path, extra) as client:
        first = list(range(10, 60))
        reply = client.generate([first])["r0"][0]
        for other in (list(range(100, 150)), list(range(150, 200)), list(range(200, 250))):
            client.generate([other])  # their snapshots and pages push the first conversation's out to the host
        second = first + reply + [7, 8, 9]
        got = client.generate([second])["r0"]
        assert client.cached["r0"] == len(first) + len(reply) - 1  # its terminal endpoint, from the host tiers
        assert got == (single_rank_tokens(core, [second], page_size=16, chunk=48)[0], "length", None)
    assert "and 8 snapshot rows" in (tmp_path / "rank1.log").read_text()
    third = second + got[0] + [4, 5, 6]
    with serving_ranks(core, 2, address, tmp_path, extra) as client:
        again = client.generate([third])["r0"]
        assert client.cached["r0"] == len(second) + len(got[0]) - 1  # the second turn's end, from both ranks' files
        assert again == (single_rank_tokens(core, [third], page_size=16, chunk=48)[0], "length", None)


@pytest.mark.slow
def test_tiny_core_over_three_ranks_then_rank_0_dies_while_idle(tiny_core: Path, tmp_path: Path) -> None:
    expected = single_rank_tokens(tiny_core, PROMPTS, page_size=16, chunk=48)
    address = f"ipc://{tmp_path}/engine.sock"
    ranks = start_ranks(tiny_core, 3, address, tmp_path)
    try:
        client = WireClient(address)
        got = client.generate(PROMPTS)
        client.close()
        assert [got[f"r{i}"] for i in range(len(PROMPTS))] == [(t, "length", None) for t in expected]
        ranks[0].kill()  # no step runs: the heartbeat (or the closed connection) tells ranks 1 and 2
        assert exit_statuses(ranks, 30) == [-signal.SIGKILL, GROUP_FAILED, GROUP_FAILED]
        assert "rank 0" in (tmp_path / "rank1.log").read_text()
    finally:
        exit_statuses(ranks, 0.1)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe", "gemma3_text", "qwen3_5", "qwen3_next", "qwen3_moe-fp8"])
def test_each_family_over_two_ranks_equals_one(family: str, tmp_path: Path) -> None:
    """q/k/v biases split by heads; experts split by columns (w13 rows of gate and up, w2 columns); Gemma's norms
    and sliding-window layers; the hybrids' linear attention by key heads with their value heads (each rank's
    recurrent state its heads' rows, carried from chunk to chunk), gated attention's q rows with their gates, and
    Qwen3-Next's shared expert by its columns; FP8 values split as their weights, per-channel scales with their rows
    and block scales by whole blocks."""
    core = write_tiny_core(tmp_path, family.removesuffix("-fp8"))
    if family.endswith("-fp8"):
        as_fp8(core, (8, 8))  # block scales of 8 rows and columns: every split falls between blocks
    expected = single_rank_tokens(core, PROMPTS, page_size=16, chunk=48)
    # A hybrid's next turns restore the snapshots the first ones left, into each rank's own state rows.
    turns = [p + t + [7, 8] for p, t in zip(PROMPTS, expected)] if family in HYBRIDS else []
    expected_turns = single_rank_tokens(core, turns, page_size=16, chunk=48) if turns else []
    address = f"ipc://{tmp_path}/engine.sock"
    ranks = start_ranks(core, 2, address, tmp_path)
    try:
        client = WireClient(address)
        got = client.generate(PROMPTS)
        assert [got[f"r{i}"] for i in range(len(PROMPTS))] == [(t, "length", None) for t in expected]
        got = client.generate(turns)
        client.close()
        assert [got[f"r{i}"] for i in range(len(turns))] == [(t, "length", None) for t in expected_turns]
        assert [client.cached[f"r{i}"] for i in range(len(turns))] == [len(t) - 3 for t in turns], client.cached
    finally:
        for rank in ranks:
            rank.kill()
        exit_statuses(ranks, 10)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "gemma3_text", "qwen3_next"])
def test_ranks_on_two_gpus_run_graphs_with_one_ranks_tokens(family: str, tmp_path: Path) -> None:
    """Each rank's GraphExecutor holds the all-reduces in its captured graphs (NCCL); fp32, so greedy tokens equal
    one rank's on the CPU, and the ranks' eager executors (`--eager`) give the same; Qwen3-Next's split linear
    attention and shared expert on the GPU backend too."""
    core = write_tiny_core(tmp_path, family)
    expected = [(t, "length", None) for t in single_rank_tokens(core, PROMPTS, page_size=16, chunk=48)]
    for extra in ([], ["--eager"]):
        address = f"ipc://{tmp_path}/engine-{len(extra)}.sock"
        ranks = start_ranks(core, 2, address, tmp_path, "cuda", extra)
        try:
            client = WireClient(address)
            got = client.generate(PROMPTS)
            client.close()
            assert [got[f"r{i}"] for i in range(len(PROMPTS))] == expected, extra
            ranks[0].send_signal(signal.SIGTERM)
            assert exit_statuses(ranks, 60) == [0, 0], (tmp_path / "rank1.log").read_text()
        finally:
            exit_statuses(ranks, 0.1)


def test_experts_split_by_columns_keep_each_experts_gate_and_up_rows_together() -> None:
    config = DecoderConfig.from_hf("qwen3_moe", {**TINY, **FAMILY_CONFIGS["qwen3_moe"]})
    w13 = torch.arange(8 * 96 * 2).view(8, 96, 2)  # [E, 2I, H] with I = 48
    parts = [Shard.of(config, rank, 3).read(w13, 1, "expert_columns") for rank in range(3)]
    assert [p.shape[1] for p in parts] == [32, 32, 32]
    gate = torch.cat([p[:, :16] for p in parts], dim=1)
    up = torch.cat([p[:, 16:] for p in parts], dim=1)
    assert torch.equal(gate, w13[:, :48]) and torch.equal(up, w13[:, 48:])


def test_linear_attention_splits_by_key_heads_each_with_its_value_heads() -> None:
    config = DecoderConfig.from_hf("qwen3_5", {**TINY, **FAMILY_CONFIGS["qwen3_5"]})  # 2 key heads, 4 value heads
    qkv = torch.arange(config.linear.conv_dim)  # q [0, 32), k [32, 64), v [64, 128): 16 rows a head
    parts = [Shard.of(config, rank, 2).read(qkv, 0, "linear_qkv") for rank in range(2)]
    assert parts[0].tolist() == [*range(0, 16), *range(32, 48), *range(64, 96)]
    assert parts[1].tolist() == [*range(16, 32), *range(48, 64), *range(96, 128)]
    local = Shard.of(config, 1, 2).local_config(config)
    assert (local.linear.num_key_heads, local.linear.num_value_heads, local.linear.conv_dim) == (1, 2, 64)
    with pytest.raises(CoreError) as caught:  # 3 ranks fit the attention heads, not the 2 key heads
        Shard.of(config, 0, 3)
    assert "2 linear-attention key heads and 4 value heads; supported world sizes: 1, 2" in str(caught.value)


def test_fp8_block_scales_split_by_whole_blocks_or_refuse() -> None:
    config = DecoderConfig.from_hf("qwen3_moe", {**TINY, **FAMILY_CONFIGS["qwen3_moe"]})
    scales = torch.arange(8 * 12 * 2).view(8, 12, 2)  # w13's [E, 2I / 8, H / 48] with I = 48, blocks of 8 rows
    parts = [Shard.of(config, rank, 3).read(scales, 1, "expert_columns", 8, 96) for rank in range(3)]
    assert torch.equal(torch.cat([p[:, :2] for p in parts] + [p[:, 2:] for p in parts], dim=1), scales)
    with pytest.raises(CoreError) as caught:  # 16 rows a rank, blocks of 32
        Shard.of(config, 1, 3).read(torch.zeros(8, 3, 2), 1, "expert_columns", 32, 96)
    message = str(caught.value)
    assert "\n" not in message and "inside its blocks of 32 (rank 1 holds 16 to 32 of 96)" in message


# --- SmolLM2 through `flare run --tp R` ------------------------------------------------------------------------

def chat_tokens(server: Server, chats: list[list[dict]]) -> list[tuple[list[int], list[int]]]:
    """(prompt token ids, greedy output token ids) of each chat, all in flight at once."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id

    def ask(messages: list[dict]) -> tuple[list[int], list[int]]:
        response = client.chat.completions.create(model=model, messages=messages, max_tokens=NEW_TOKENS,
                                                  temperature=0, extra_body={"return_token_ids": True})
        return response.model_extra["prompt_token_ids"], response.choices[0].model_extra["token_ids"]

    with ThreadPoolExecutor(len(chats)) as pool:
        return list(pool.map(ask, chats))


def engine_rank_pid(supervisor: subprocess.Popen, rank: int) -> int:
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            command = Path(f"/proc/{entry}/cmdline").read_text().split("\0")
        except (OSError, IndexError):
            continue
        if int(stat[1]) == supervisor.pid and "engine.main" in command and \
                command[command.index("--rank") + 1] == str(rank):
            return int(entry)
    raise LookupError(f"no engine rank {rank} under flare run {supervisor.pid}")


def check_against_single_rank(core: Path, served: list[tuple[list[int], list[int]]]) -> None:
    prompts = [prompt for prompt, _ in served]
    expected = single_rank_tokens(core, prompts, page_size=64, chunk=512)  # the core's pages and prefill chunks
    # An eos before NEW_TOKENS ends the server's output early; the reference ignores eos.
    assert [out for _, out in served] == [ref[:len(out)] for ref, (_, out) in zip(expected, served)]
    assert all(len(out) >= 4 for _, out in served)


@pytest.mark.slow
def test_smollm2_over_two_ranks_equals_one_then_a_clean_stop(fp32_core_dir: Path) -> None:
    core_dir = fp32_core_dir
    server = Server(core_dir, "--tp", "2")
    try:
        served = chat_tokens(server, CHATS)
    finally:
        status = server.stop()
    check_against_single_rank(core_dir, served)
    assert status == 0, server.process.stdout.read()


@pytest.mark.slow
def test_smollm2_over_three_ranks_equals_one_then_a_rank_dies_mid_stream(fp32_core_dir: Path) -> None:
    core_dir = fp32_core_dir
    server = Server(core_dir, "--tp", "3")
    try:
        served = chat_tokens(server, CHATS)
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
        stream = client.chat.completions.create(model=client.models.list().data[0].id, messages=CHATS[0],
                                                max_tokens=400, temperature=0, stream=True,
                                                extra_body={"ignore_eos": True})
        with pytest.raises(openai.APIError, match="tensor-parallel group failed: rank 1 died"):
            for i, _ in enumerate(stream):
                if i == 3:
                    os.kill(engine_rank_pid(server.process, 1), signal.SIGKILL)
        status = server.process.wait(60)
        output = server.process.stdout.read()
    finally:
        server.stop()
    assert status != 0
    assert "flare: error: engine rank 1 was killed by SIGKILL" in output, output
    assert "engine rank 0 left the failed group" in output and "engine rank 2 left the failed group" in output
    check_against_single_rank(core_dir, served)
