"""Rank 0's executor under tensor parallelism: its own executor, with every step also run by the other ranks.

The engine loop sees the usual executor protocol. A step is submitted only after every rank is ready for it
(engine/parallel/step_channel.py), and it completes only after every rank has reported the same sampled tokens, so
publication and page retirement follow the slowest rank, and so does the two-step in-flight bound (the local
executor counts a step in flight until `poll` hands it over). The engine loop calls `poll` at least once a second
(it wakes that often to heartbeat its frontends), and `poll` carries rank 0's heartbeat to the other ranks.

Any failure is the group's: a step that failed on one rank has desynchronised the collectives of all, so the executor
raises RankFailure, and the engine fails its requests and exits.
"""

from __future__ import annotations

from collections import deque

from engine.executor.base import Executor
from engine.parallel.step_channel import Leader, RankFailure
from engine.scheduler.plan import Completion, DiskDone, Plan


class TensorParallelExecutor:
    def __init__(self, local: Executor, channel: Leader) -> None:
        self.local = local
        self.channel = channel
        self.wake_fd = local.wake_fd
        self.num_pages = local.num_pages
        self.failed = False
        # The other ranks sample too, with the masks that come with the step: they never come later.
        self.late_masks = False
        self._disk_local: deque[DiskDone] = deque()  # rank 0's, until every other rank has reported them too

    @property
    def fault(self) -> str | None:
        return self.local.fault

    def can_submit(self) -> bool:
        return self.local.can_submit()

    def next_fence(self) -> int:
        return self.local.next_fence()

    def submit(self, plan: Plan) -> None:
        fence = self.local.next_fence()
        try:
            self.channel.prepare(fence, plan)
            self.channel.commit(fence)
        except RankFailure as exc:
            raise self._fail(str(exc)) from None
        self.local.submit(plan)

    def poll(self) -> list[tuple[Plan, Completion]]:
        """Rank 0's completions once every rank reported the same tokens."""
        ready = []
        try:
            self.channel.tick()
            for plan, completion in self.local.poll():
                if completion.error is not None:
                    raise RankFailure(f"rank 0: step {completion.fence} failed: {completion.error}")
                for rank, done in self.channel.done(completion.fence).items():
                    if done.tokens != completion.tokens:
                        raise RankFailure(f"rank {rank} sampled other tokens than rank 0 in step {completion.fence}")
                ready.append((plan, completion))
        except RankFailure as exc:
            raise self._fail(str(exc)) from None
        return ready

    def disk_done(self) -> list[DiskDone]:
        """Steps whose disk work ended on every rank (rank 0's first, then the others' reports as they arrive); a
        disk read that any rank could not serve (its shard's file) is unserved for all, and the work took what the
        slowest rank's did."""
        self._disk_local.extend(self.local.disk_done())
        ready = []
        while self._disk_local and (reports := self.channel.disk_done(self._disk_local[0].fence)) is not None:
            done = self._disk_local.popleft()
            unreadable = {*done.unreadable, *(slot for report in reports.values() for slot in report.unreadable)}
            seconds = max([done.seconds, *(report.seconds for report in reports.values())])
            ready.append(DiskDone(done.fence, tuple(sorted(unreadable)), seconds))
        return ready

    def close(self) -> None:
        # After a failure the local worker may be blocked in a collective for good: the process exits around it.
        if not self.failed:
            self.channel.stop()
            self.local.close()
        self.channel.close()

    def _fail(self, failure: str) -> RankFailure:
        """Name what happened on each rank, tell the ranks to exit, and return the error to raise."""
        self.failed = True
        reason = self.channel.diagnose(failure)
        self.channel.stop(reason)
        return RankFailure(f"tensor-parallel group failed: {reason}")
