"""Holding SIGINT back for a few steps that a KeyboardInterrupt must not cut in two."""

# _signal is the C module behind signal: the same calls without the enum conversions, which
# cost ten times the system calls themselves (8 us instead of 1 us per hold here).
import _signal
import threading


class HeldInterrupts:
    """Holds SIGINT back while a request's state changes, so KeyboardInterrupt never falls
    between a demand sent and its id recorded, a reply read and its lease recorded, or in the
    middle of a multipart message (which would garble the next one, a release perhaps).

    Only the main thread receives KeyboardInterrupt, so elsewhere this does nothing. A SIGINT
    that arrives meanwhile is delivered by :meth:`deliver` (or on exit) to the handler that
    was installed, which raises KeyboardInterrupt as usual.
    """

    def __enter__(self):
        self._pending = self._previous = None
        if threading.current_thread() is threading.main_thread():
            if callable(_signal.getsignal(_signal.SIGINT)):
                self._previous = _signal.signal(_signal.SIGINT, self._record)
        return self

    def _record(self, signum, frame) -> None:
        self._pending = (signum, frame)

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def deliver(self) -> None:
        """Put the handler back and run it for a SIGINT held back (it usually raises)."""
        previous, self._previous = self._previous, None
        if previous is not None:
            _signal.signal(_signal.SIGINT, previous)
            pending, self._pending = self._pending, None
            if pending is not None:
                previous(*pending)

    def __exit__(self, *exc):
        self.deliver()
