"""How a loop tries again: the one retry policy of the client's loops (a lease that lapsed, a
pull that lost its epoch, a speculative step replayed, a daemon waited for). The loop that waits
across daemon restarts is the session's own (client/attach.py: ``_across_restarts``)."""

import time
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    """At most ``attempts`` tries (None: no bound of its own; the loop ends on success, or on
    a deadline of the caller's), ``pause`` seconds apart.

    Raises:
        ValueError: ``attempts`` below 1 or ``pause`` below 0.
    """

    attempts: int | None = None
    pause: float = 0.0

    def __post_init__(self):
        if self.attempts is not None and self.attempts < 1:
            raise ValueError(f"attempts must be at least 1, not {self.attempts}")
        if self.pause < 0:
            raise ValueError(f"pause must be at least 0, not {self.pause}")

    def tries(self) -> Iterator[int]:
        """The tries' numbers, 0 first; each after the first comes ``pause`` s after the one
        before ended. A loop that succeeds breaks out; one that runs out falls through."""
        attempt = 0
        while self.attempts is None or attempt < self.attempts:
            if attempt and self.pause:
                time.sleep(self.pause)
            yield attempt
            attempt += 1
