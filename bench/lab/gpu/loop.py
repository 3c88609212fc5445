"""Steady decode through the real engine loop (engine/core.py) on the GPU: an in-process engine bound to a ZMQ
socket, fed by a DEALER client speaking the wire protocol, as a frontend would. The client runs in a process of its
own, as a frontend does in a deployment: it decodes every Outputs message, and as a thread of the engine's process
that work competed with the engine loop for the GIL. The GPU's busy fraction is read off the graph executor's
per-step CUDA events."""

from __future__ import annotations

import multiprocessing
import os
import random
import tempfile
import threading
import uuid

import zmq

from common import protocol as wire
from engine.core import Engine
from engine.executor.graph import GraphExecutor
from engine.main import cache_identity
from engine.scheduler.scheduler import RequestScheduler
from engine.telemetry import EngineTelemetry


def client(address: str, batch: int, prompt_len: int, max_tokens: int, vocab: int) -> None:
    """The frontend's side, in its own process: submit `batch` prompts, read Outputs until every request ended."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
    socket.connect(address)
    socket.send(wire.encode(wire.Hello(wire.PROTOCOL_VERSION, "bench")))
    params = wire.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    generator = random.Random(0)
    for i in range(batch):
        prompt = [generator.randrange(vocab - 8) for _ in range(prompt_len)]
        socket.send(wire.encode(wire.Submit(f"b{i}", prompt, params)))
    finished = 0
    while finished < batch:
        message = wire.decode_engine_message(socket.recv())
        if isinstance(message, wire.Outputs):
            finished += sum(reason is not None for reason in message.finish_reasons)
    socket.close()


def busy_fraction(spans: list[tuple[float, float, int, str]], batch: int) -> tuple[float, float, int]:
    """Over the longest run of consecutive full-batch decode steps: (busy fraction, ms per step, steps)."""
    best: list[tuple[float, float, int, str]] = []
    run: list[tuple[float, float, int, str]] = []
    for span in spans:
        if span[3] == "decode" and span[2] == batch:
            run.append(span)
            if len(run) > len(best):
                best = list(run)
        else:
            run = []
    best = best[5:]  # the first steps of a run still overlap the prefill's tail on the host
    wall = best[-1][1] - best[0][0]
    return sum(end - start for start, end, _, _ in best) / wall, wall / len(best), len(best)


def engine_loop_busy(model, manifest, executor: GraphExecutor, max_active: int, batch: int, prompt_len: int,
                     max_tokens: int) -> tuple[float, float, int]:
    caps = manifest.capacities
    scheduler = RequestScheduler(max_active, caps.queue_capacity, executor.num_pages, caps.page_size,
                                 caps.prefill_chunk_size, cache_identity(manifest, model.model.embed_tokens.weight.dtype))
    context = zmq.Context.instance()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    address = f"ipc://{tempfile.gettempdir()}/flare-bench-{uuid.uuid4().hex[:8]}.sock"
    socket.bind(address)
    telemetry_socket = context.socket(zmq.XPUB)
    telemetry_address = f"inproc://flare-telemetry-{uuid.uuid4().hex[:8]}"
    telemetry_socket.bind(telemetry_address)
    telemetry = EngineTelemetry(telemetry_socket, "engine-bench")
    card = wire.ModelCard(served_names=manifest.served_names, checkpoint=manifest.checkpoint,
                          architecture=manifest.architecture, context_limit=manifest.context_limit,
                          eos_token_ids=manifest.eos_token_ids, created=manifest.created)
    engine = Engine(card, executor, scheduler, model.config.vocab_size, socket, telemetry, telemetry_address)
    executor.spans.clear()
    feeder = multiprocessing.get_context("spawn").Process(
        target=client, args=(address, batch, prompt_len, max_tokens, model.config.vocab_size), daemon=True)
    feeder.start()

    def stop_when_fed() -> None:  # nothing is left to cancel: this only ends the loop once steps in flight drain
        feeder.join()
        engine.stop()

    stopper = threading.Thread(target=stop_when_fed, daemon=True)  # blocked in join: it takes no GIL time
    stopper.start()
    try:
        engine.run()
        stopper.join()
        if feeder.exitcode != 0:
            raise RuntimeError(f"the bench client exited with {feeder.exitcode}")
        return busy_fraction(list(executor.spans), batch)
    finally:
        executor.close()
        socket.close()
        telemetry_socket.close()
        os.unlink(address.removeprefix("ipc://"))
