"""The loop of a rank > 0: run the steps rank 0 commits, in its order, on this rank's shard, until told to stop.

Each rank samples the same tokens from the same gathered logits (sampling is a pure function of logits, seed and
position), so every rank's executor keeps the same per-slot token on its device for the next decode step; Done
carries the tokens to rank 0, which checks that they agree.
"""

from __future__ import annotations

import logging

import zmq

from common.ranks import DEVICE_FAULT, GROUP_FAILED
from engine.executor.base import Executor
from engine.executor.faults import DeviceFault
from engine.parallel.step_channel import (BEAT_INTERVAL, Commit, DiskWorkDone, Done, Follower, Prepare, RankFailure,
                                         Ready, Stop)
from engine.scheduler.plan import Plan

log = logging.getLogger("flare.engine")


def check_plan(plan: Plan, num_pages: int, page_size: int, max_active: int, vocab_size: int,
               host_slots: int = 0, state_rows: int = 0, host_snapshots: int = 0) -> str | None:
    """Why this rank could not run the step, or None: what would fail here before the first collective.
    `state_rows`: a hybrid model's recurrent-state rows (its slots' and snapshots'), `host_snapshots` its host
    snapshot rows."""
    for row in plan.rows:
        if not 0 <= row.slot < max_active:
            return f"slot {row.slot} is outside [0, {max_active})"
        if row.length < 1 or len(row.page_table) * page_size < row.start + row.length:
            return f"row of slot {row.slot} has length {row.length} or too few pages for its positions"
        if any(not 0 <= page < num_pages for page in row.page_table):
            return f"row of slot {row.slot} names a page outside [0, {num_pages})"
        if row.tokens is not None and (len(row.tokens) != row.length
                                       or any(not 0 <= t < vocab_size for t in row.tokens)):
            return f"row of slot {row.slot} carries {len(row.tokens)} tokens for {row.length} positions, or ids " \
                   f"outside the vocabulary"
    if any(not (0 <= src < num_pages and 0 <= dst < num_pages) for src, dst in plan.copies):
        return f"a page copy names a page outside [0, {num_pages})"
    moves = plan.spills + tuple((page, slot) for slot, page in plan.restores)  # spills (page, slot); restores reversed
    if any(not (0 <= page < num_pages and 0 <= slot < host_slots) for page, slot in moves):
        return f"a host-tier copy names a page outside [0, {num_pages}) or a host slot outside [0, {host_slots})"
    rows = plan.state_spills + tuple((row, host) for host, row in plan.state_restores)  # (state row, host row)
    if any(not (0 <= row < state_rows and 0 <= host < host_snapshots) for row, host in rows):
        return f"a host-tier copy names a state row outside [0, {state_rows}) or a host snapshot row outside " \
               f"[0, {host_snapshots})"
    if plan.disk is not None and any(not 0 <= work.slot < host_slots or not -1 <= work.snapshot < host_snapshots
                                     for work in plan.disk.writes + plan.disk.reads):
        return f"disk work names a host slot outside [0, {host_slots}) or a host snapshot row outside " \
               f"[0, {host_snapshots})"
    return None


def serve(channel: Follower, executor: Executor, page_size: int, max_active: int, vocab_size: int,
          host_slots: int, state_rows: int = 0, host_snapshots: int = 0) -> int:
    """Returns the exit status: 0 when rank 0 stopped the group cleanly, GROUP_FAILED on any failure."""
    poller = zmq.Poller()
    poller.register(channel.socket, zmq.POLLIN)
    poller.register(executor.wake_fd, zmq.POLLIN)
    prepared: Prepare | None = None
    try:
        while True:
            for message in channel.receive():
                if isinstance(message, Prepare):
                    if message.fence != executor.next_fence() or not executor.can_submit():
                        raise RankFailure(f"step {message.fence} arrived out of order (next is "
                                          f"{executor.next_fence()}, two steps at most in flight)")
                    problem = check_plan(message.plan, executor.num_pages, page_size, max_active, vocab_size,
                                         host_slots, state_rows, host_snapshots)
                    if problem:
                        raise RankFailure(f"cannot run step {message.fence}: {problem}")
                    prepared = message
                    channel.send(Ready(message.fence))
                elif isinstance(message, Commit):
                    if prepared is None or prepared.fence != message.fence:
                        raise RankFailure(f"commit of step {message.fence}, which was not prepared")
                    executor.submit(prepared.plan)
                    prepared = None
                elif isinstance(message, Stop):
                    if message.reason is not None:
                        log.error("rank 0 stopped the group: %s", message.reason)
                        return GROUP_FAILED
                    executor.close()
                    return 0
            for _, completion in executor.poll():
                if completion.error is not None:
                    raise RankFailure(f"step {completion.fence} failed: {completion.error}")
                channel.send(Done(completion.fence, completion.tokens))
            for done in executor.disk_done():
                channel.send(DiskWorkDone(done.fence, done.unreadable, done.seconds))
            channel.tick()
            poller.poll(int(BEAT_INTERVAL * 1000))
    except RankFailure as exc:
        log.error("%s; leaving the group", exc)
        channel.fail(str(exc))
        return GROUP_FAILED
    except DeviceFault as exc:  # this rank's own failure, not the group's
        log.error("the device failed; leaving the group: %s", exc)
        channel.fail(f"the device failed: {exc}")
        return DEVICE_FAULT
    finally:
        channel.close()
