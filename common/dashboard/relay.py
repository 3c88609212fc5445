"""The supervisor's children's output, routed so that the dashboard can hold the terminal without being scribbled on.

With a terminal, every child writes stdout and stderr into one pipe; a thread copies its lines to the supervisor's
stderr, or, while the dashboard holds the terminal, keeps them for its log view and prints them when it lets go, so
that nothing logged meanwhile (a traceback, say) is lost. Log lines are short writes, so children do not interleave
within a line.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import deque

HELD_LINES = 1000


class OutputRelay:
    def __init__(self) -> None:
        read_fd, self.write_fd = os.pipe()
        self._lock = threading.Lock()
        self._held: deque[str] | None = None
        self._total = 0  # lines held since hold(), including those the bounded deque let go
        self._thread = threading.Thread(target=self._pump, args=(read_fd,), daemon=True, name="flare-output")
        self._thread.start()

    def hold(self) -> None:
        with self._lock:
            self._held, self._total = deque(maxlen=HELD_LINES), 0

    def release(self) -> None:
        with self._lock:
            held, self._held = self._held or (), None
            sys.stderr.writelines(held)
            sys.stderr.flush()

    def close(self, timeout: float = 2.0) -> None:
        """Once the children have exited: pass on what they wrote last (the pipe ends when no writer is left)."""
        os.close(self.write_fd)
        self._thread.join(timeout)

    def read_after(self, seen: int) -> tuple[int, list[str]]:
        """Lines held after the first `seen` (as many of them as are still kept), and the new count to pass next."""
        with self._lock:
            held = list(self._held or ())
            fresh = min(self._total - seen, len(held))
            return self._total, held[len(held) - fresh:]

    def _pump(self, fd: int) -> None:
        with open(fd, encoding="utf-8", errors="replace") as stream:
            for line in stream:
                with self._lock:
                    if self._held is None:
                        sys.stderr.write(line)
                        sys.stderr.flush()
                    else:
                        self._held.append(line)
                        self._total += 1
