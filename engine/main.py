"""`flare-engine --rank N --world-size R --core DIR --dist-address HOST:PORT [--listen ADDR]`: one engine process per
GPU rank. Rank 0 serves the frontends at --listen and schedules; the other ranks run the steps it sends them."""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import signal
import sys
import time
import uuid
from pathlib import Path

import torch
import zmq

from common import protocol
from common.engine_flags import add_engine_flags
from common.errors import CoreError
from common.links import LinkKeyError, LinkKeys, add_link_flags, bound, exposure_problem, frame_limit, load_keys
from common.manifest import Manifest
from common.protocol import ModelCard
from common.ranks import DEVICE_FAULT, GROUP_FAILED
from engine.cache import disk_files
from engine.cache.disk_tier import DiskTier
from engine.cache.host_tier import HostTier
from engine.core import Engine
from engine.executor.eager import pages_for_budget
from engine.executor.factory import (HOST_LIMIT, available_memory, gpu_kv_budget, gpu_step_tokens, host_budget,
                                     make_executor)
from engine.executor.faults import DeviceFault, sticky_fault
from engine.executor.tier_copies import host_slot_bytes, slot_shape
from engine.model import kv_quant
from engine.model.attention import PagedAttention
from engine.model.decoder import CausalLM
from engine.model.loader import DTYPES, load_model
from engine.model.recurrent_state import RecurrentState, host_snapshot_rows, snapshot_rows
from engine.parallel.executor import TensorParallelExecutor
from engine.parallel.group import join, rank_device
from engine.parallel.step_channel import Follower, RankFailure, connect
from engine.parallel.worker import serve
from engine.sampling.grammar import GrammarCompiler
from engine.scheduler.scheduler import RequestScheduler
from engine.speculative.factory import make_proposer, target_share
from engine.telemetry import EngineTelemetry
from engine.threads import set_threads

log = logging.getLogger("flare.engine")


def cache_identity(manifest: Manifest, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> bytes:
    """32 bytes naming the weights and the recipe that shape the KV cache: prefix keys (and disk files) of different
    cores, dtypes or KV dtypes never meet. A cache of the model's own dtype keeps the identity it had before KV
    dtypes were a choice, so that its disk files stay valid."""
    kv = f"|kv {kv_dtype}" if kv_dtype not in (None, dtype) else ""
    recipe = f"{sorted(manifest.files.items())}|{dtype}{kv}|{manifest.capacities.page_size}".encode()
    return hashlib.sha256(recipe).digest()


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flare-engine", description=__doc__)
    parser.add_argument("--rank", type=int, default=0, help="this process's tensor-parallel rank")
    parser.add_argument("--world-size", type=int, default=1, help="tensor-parallel ranks, one process each")
    parser.add_argument("--dist-address", help="HOST:PORT where rank 0 hosts the ranks' rendezvous, reachable from "
                                               "every rank (needed with --world-size > 1)")
    parser.add_argument("--core", type=Path, required=True, help="core directory made by `ignition export`")
    parser.add_argument("--listen", help="ZMQ address to bind on rank 0, e.g. ipc:///run/user/1000/flare/engine.sock")
    add_link_flags(parser, binds=True)
    parser.add_argument("--threads", type=int,
                        help="torch CPU threads (default: OMP_NUM_THREADS, else the cores this process may use)")
    add_engine_flags(parser, "engine flags (flare run forwards them)")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = make_parser()
    args = parser.parse_args(argv)
    if not 0 <= args.rank < args.world_size:
        parser.error(f"--rank {args.rank} is outside [0, --world-size {args.world_size})")
    if args.world_size > 1 and not args.dist_address:
        parser.error("--world-size > 1 needs --dist-address HOST:PORT")
    if args.rank == 0 and not args.listen:
        parser.error("rank 0 needs --listen")
    if args.host_cache_bytes is not None and args.host_cache_bytes < 0:
        parser.error(f"--host-cache-bytes must be at least 0, got {args.host_cache_bytes}")
    if args.host_cache_bytes and args.host_cache_bytes > HOST_LIMIT * (available := available_memory()):
        # Given more, the tier would push the machine into swapping or the kernel's OOM killer once filled (and on
        # a GPU it is locked at start).
        parser.error(f"--host-cache-bytes {args.host_cache_bytes} is more than {HOST_LIMIT:.0%} of the host memory "
                     f"available now ({available / (1 << 30):.1f} GiB)")
    if args.disk_cache_bytes is not None and args.disk_cache is None:
        parser.error("--disk-cache-bytes needs --disk-cache DIR")
    if args.disk_cache is not None and not args.disk_cache.is_dir():
        parser.error(f"--disk-cache {args.disk_cache} is not a directory")
    if args.kv_cache_fraction is not None and not 0 < args.kv_cache_fraction <= 1:
        parser.error(f"--kv-cache-fraction must be in (0, 1], got {args.kv_cache_fraction}")
    for flag in ("max_active", "max_batched_tokens", "kv_cache_bytes"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    return args


def link_keys(args: argparse.Namespace) -> LinkKeys | None:
    """The deployment's link keys; exits with one line when they are unreadable, or when an address other hosts can
    reach (the request socket or the ranks' channel) would be served without them."""
    try:
        keys = load_keys(args.engine_keys)
    except LinkKeyError as exc:
        sys.exit(f"flare-engine: error: {exc}")
    for address in ([args.listen] if args.listen else []) + \
            ([f"tcp://{args.dist_address}"] if args.world_size > 1 else []):
        if (problem := exposure_problem(address, keys, args.insecure_engine_link)) is not None:
            sys.exit(f"flare-engine: error: {problem}")
    if args.insecure_engine_link and keys is None:
        log.warning("--insecure-engine-link: anyone who reaches %s can submit requests and read telemetry",
                    args.listen or args.dist_address)
    return keys


def select_device(name: str) -> tuple[torch.device, str]:
    """The device and why it was chosen: `auto` takes the GPU only when both CuPy (graph launches) and torch can
    use it."""
    if name != "auto":
        return torch.device(name), "as asked"
    if not torch.cuda.is_available():
        return torch.device("cpu"), "torch sees no CUDA GPU"
    try:
        import cupy
    except ImportError:
        return torch.device("cpu"), "a GPU is present but CuPy is missing (install the gpu extra)"
    if not cupy.cuda.is_available():
        return torch.device("cpu"), "a GPU is present but CuPy cannot use it"
    return torch.device("cuda"), f"{torch.cuda.get_device_name()} found"


def retained_pages(args: argparse.Namespace, model: CausalLM, device: torch.device, page_size: int,
                   dtype: torch.dtype, kv_dtype: torch.dtype, world_size: int) -> tuple[int, int]:
    """The host tier's pages (of `kv_dtype`) and snapshot rows (a hybrid model's, of `dtype`; docs/design.md, Host
    retention). Under tensor parallelism each rank keeps its shard of a page (and of a snapshot row), and the default
    budget is shared by the ranks of the machine."""
    budget = host_budget(device) // world_size if args.host_cache_bytes is None else args.host_cache_bytes
    rows = host_snapshot_rows(model.config, dtype, budget) if model.config.hybrid else 0
    if budget and model.config.hybrid and not rows:
        log.info("no host tier: the budget holds no recurrent-state snapshot row")
        return 0, 0
    row_bytes = rows * RecurrentState.row_bytes(model.config, dtype)
    slots = (budget - row_bytes) // host_slot_bytes(model.config, page_size, kv_dtype)
    if slots:
        log.info("host tier: %d pages%s (%.2f GiB)", slots, f" and {rows} snapshot rows" if rows else "",
                 (slots * host_slot_bytes(model.config, page_size, kv_dtype) + row_bytes) / (1 << 30))
    return slots, rows if slots else 0


def disk_directory(args: argparse.Namespace) -> Path:
    """The rank's directory of the disk tier: the one given, or under tensor parallelism one per rank of the group
    in it, each rank writing its shard of every page."""
    if args.world_size == 1:
        return args.disk_cache
    directory = args.disk_cache / f"rank{args.rank}-of-{args.world_size}"
    directory.mkdir(mode=0o700, exist_ok=True)
    return directory


def disk_tier(args: argparse.Namespace, directory: Path, identity: bytes, model: CausalLM, page_size: int,
              dtype: torch.dtype, state_dtype: torch.dtype) -> DiskTier:
    """The disk tier below the host's, with the files a previous run of the same core left (docs/design.md, Host
    retention); files of other cores, dtypes or layouts are skipped and logged. Its entries are rank 0's files;
    the budget holds every rank's."""
    budget = args.disk_cache_bytes if args.disk_cache_bytes is not None else \
        shutil.disk_usage(args.disk_cache).free // 2
    layout = disk_files.Layout(identity, str(dtype), slot_shape(model.config, page_size),
                               RecurrentState.row_bytes(model.config, state_dtype))
    found = disk_files.scan(directory, layout)
    # (a hybrid's files with a snapshot are larger: the budget counts pages, as if none had one)
    tier = DiskTier(budget // ((layout.payload_bytes + disk_files.MAX_HEADER) * args.world_size), found)
    log.info("disk tier: %s, %d pages, %d found", directory, tier.capacity, len(tier))
    return tier


def log_kv_cache(model: CausalLM, choice: str) -> None:
    """Where an FP8 KV cache's scales come from, and what of a hybrid model stays in its dtype."""
    if choice != "fp8":
        return
    scales = [m.kv_scale for m in model.modules() if isinstance(m, PagedAttention)]
    calibrated = sum(bool((s != 1).any()) for s in scales)
    log.info("KV cache in fp8 (e4m3): %s", f"the core's scales in {calibrated} of {len(scales)} attention layers"
             if calibrated else "scales 1.0 (the core carries none)")
    if model.config.hybrid:
        log.info("fp8 holds the KV of the %d full-attention layers only; the linear-attention layers' recurrent "
                 "state keeps its dtypes", len(scales))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s engine[{args.rank}] %(levelname)s %(message)s")
    keys = link_keys(args)
    threads = set_threads(args.threads)
    started = time.monotonic()
    chosen, reason = select_device(args.device)
    device = rank_device(chosen, args.rank)
    log.info("device %s: %s", device, reason)
    if args.kv_cache_dtype == "fp8" and (problem := kv_quant.unsupported(device)):
        sys.exit(f"flare-engine: error: {problem}")
    tp = join(args.rank, args.world_size, args.dist_address, device) if args.world_size > 1 else None
    try:
        manifest, model = load_model(args.core, device, DTYPES[args.dtype] if args.dtype else None, tp=tp,
                                     fp8_kv=args.kv_cache_dtype == "fp8")
    except CoreError as exc:
        sys.exit(f"flare-engine: error: {exc}")
    caps = manifest.capacities
    max_active = args.max_active or caps.max_active
    budget = args.kv_cache_bytes or (gpu_kv_budget(model, max_active, device, args.kv_cache_fraction)
                                     if device.type == "cuda" else caps.kv_cache_bytes)
    if device.type == "cuda" and not args.kv_cache_bytes:  # the draft model's weights and pages come out of it
        budget = target_share(budget, args.speculative, args.draft)
    step_tokens = args.max_batched_tokens or (gpu_step_tokens(device, caps.prefill_chunk_size)
                                              if device.type == "cuda" else caps.prefill_chunk_size)
    log.info("up to %d prompt tokens a step%s", step_tokens, "" if args.max_batched_tokens else " (default)")
    dtype = model.model.embed_tokens.weight.dtype
    kv_dtype = model.cache_dtype
    log_kv_cache(model, args.kv_cache_dtype)
    snapshots = snapshot_rows(model.config, dtype, max_active, budget) if model.config.hybrid else None
    if snapshots is not None:  # a hybrid's state rows, its slots' and its snapshots', come out of the cache budget
        budget -= (max_active + snapshots) * RecurrentState.row_bytes(model.config, dtype)
        log.info("%d recurrent-state snapshot rows for exact prefix checkpoints", snapshots)
    num_pages = pages_for_budget(model, caps.page_size, budget, kv_dtype)
    limit = frame_limit(manifest.context_limit, manifest.vision)
    # A step's rows carry their requests' images (a vision model's eager step places text by them), so one step
    # message may hold what max_active Submits held.
    channel = connect(tp, args.dist_address, keys, limit * max_active) if tp else None
    host_slots, host_snapshots = retained_pages(args, model, device, caps.page_size, dtype, kv_dtype,
                                                args.world_size)
    if channel:  # every rank allocates the same pages and slots
        num_pages, max_active, host_slots, host_snapshots = channel.setup(num_pages, max_active, host_slots,
                                                                          host_snapshots)
        if model.config.hybrid and not host_snapshots:  # (some rank's budget holds no snapshot row)
            host_slots = 0
    identity = cache_identity(manifest, dtype, kv_dtype)
    directory = disk_directory(args) if args.disk_cache is not None and host_slots else None
    disk = disk_tier(args, directory, identity, model, caps.page_size, kv_dtype, dtype) \
        if directory is not None and args.rank == 0 else None
    if args.disk_cache is not None and directory is None:
        log.warning("no disk tier: it takes what a host tier gives up, and there is none (--host-cache-bytes)")
    executor = make_executor(model, num_pages, caps.page_size, max_active, device, manifest.context_limit,
                             step_tokens, graphs=not args.eager, snapshots=snapshots or 0, host_slots=host_slots,
                             disk=(directory, identity) if directory is not None else None,
                             host_snapshots=host_snapshots)
    if channel:
        channel.start()
        if isinstance(channel, Follower):
            log.info("rank %d of %d: shard loaded in %.1fs, %d KV pages; following rank 0", args.rank,
                     args.world_size, time.monotonic() - started, num_pages)
            os._exit(serve(channel, executor, caps.page_size, max_active, model.config.vocab_size, host_slots,
                           max_active + (snapshots or 0), host_snapshots))
        executor = TensorParallelExecutor(executor, channel)
    speculative = args.speculative
    if model.config.hybrid and speculative != "off":
        # A rejected draft would have to roll the linear-attention layers' recurrent state back to the accepted
        # prefix, which the engine does not do.
        log.info("speculative decoding off: %s carries a recurrent state that a rejected draft cannot roll back",
                 manifest.architecture)
        speculative = "off"
    try:
        proposer = make_proposer(speculative, args.draft, manifest, device, caps.page_size, budget,
                                 max_active, step_tokens, graphs=not args.eager)
    except CoreError as exc:
        sys.exit(f"flare-engine: error: {exc}")
    scheduler = RequestScheduler(max_active, caps.queue_capacity, num_pages, caps.page_size, step_tokens,
                                 identity, proposer=proposer,
                                 snapshots=snapshots, snapshot_bytes=RecurrentState.row_bytes(model.config, dtype),
                                 host=HostTier(host_slots, host_snapshots) if host_slots else None,
                                 page_bytes=host_slot_bytes(model.config, caps.page_size, kv_dtype), disk=disk,
                                 late_masks=executor.late_masks)
    card = ModelCard(served_names=manifest.served_names, checkpoint=manifest.checkpoint,
                     architecture=manifest.architecture, context_limit=manifest.context_limit,
                     eos_token_ids=manifest.eos_token_ids, created=manifest.created)
    context = zmq.Context()
    authenticator = keys.authenticate(context) if keys else None
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 1000)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    telemetry_socket = context.socket(zmq.XPUB)
    for link in (socket, telemetry_socket):
        bound(link, limit)
        if keys:
            keys.serve(link)
    socket.bind(args.listen)
    # Every subscribe and unsubscribe reaches the engine, so it can count attached dashboards (see telemetry.py).
    telemetry_socket.setsockopt(zmq.XPUB_VERBOSER, 1)
    telemetry_socket.setsockopt(zmq.LINGER, 0)
    telemetry_address = protocol.telemetry_address(args.listen)
    telemetry_socket.bind(telemetry_address)
    telemetry = EngineTelemetry(telemetry_socket, f"engine-{uuid.uuid4().hex[:8]}", kv_dtype.itemsize)
    tokenizer = args.core / "tokenizer.json"  # a core without one serves token ids only: no structured output
    grammars = GrammarCompiler(tokenizer.read_text(), model.config.vocab_size, manifest.eos_token_ids) \
        if tokenizer.is_file() else None
    engine = Engine(card, executor, scheduler, model.config.vocab_size, socket, telemetry, telemetry_address,
                    grammars, manifest.vision)
    signal.signal(signal.SIGTERM, lambda *_: engine.stop())
    signal.signal(signal.SIGINT, lambda *_: engine.stop())
    log.info("loaded %s (%s, %s) on %s (%d threads) in %.1fs: %d KV pages of %d tokens in %s, %d slots, "
             "speculative %s; listening on %s", manifest.served_names[0], manifest.architecture,
             manifest.quantization or manifest.dtype, device, threads, time.monotonic() - started, num_pages,
             caps.page_size, kv_quant.KV_NAMES.get(kv_dtype, str(kv_dtype).removeprefix("torch.")), max_active,
             proposer.name if proposer else "off", args.listen)
    status = 0
    try:
        engine.run()
    except RankFailure as exc:
        log.error("%s", exc)
        engine.fail(str(exc))
        status = GROUP_FAILED
    except Exception as exc:  # a device fault, or whatever the loop raised once the device had failed
        fault = str(exc) if isinstance(exc, DeviceFault) else sticky_fault(device)
        if fault is None:
            raise
        # Nothing more can run on this device: fail everything, exit, and let flare run decide.
        log.error("the device failed; stopping: %s", fault)
        engine.fail(f"the engine's device failed and the engine stopped: {fault}")
        status = DEVICE_FAULT
    finally:
        if status != DEVICE_FAULT:  # draining a failed device can hang; the exit frees its memory
            executor.close()
        if grammars is not None:
            grammars.close()
        socket.close()
        telemetry_socket.close()
        if authenticator is not None:
            authenticator.stop()
        context.term()
    log.info("stopped")
    os._exit(status)


if __name__ == "__main__":
    main()
