"""What a session holds apart from itself, so that a model dropped without ``close()`` (or
left at exit) still has its threads and socket shut, in order, by the session's finalizer."""

import weakref

from expertd.protocol import Op

GOODBYE_LINGER = 0.2  # how long a closing session lets its goodbye reach the daemon


class Links:
    """A session's copier, connection and heartbeat thread, shut in order: the copier, the
    heartbeat thread (it closes its own socket, and stops using the connection's to release
    late leases), then the connection. Holds nothing of the session."""

    def __init__(self):
        self.copier = self.conn = self.heartbeat = None

    def detach(self, goodbye: bool) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.conn is not None:
            # Bounded: the daemon may be gone (else it times this client out instead).
            queued = goodbye and self.conn.send_quietly(Op.GOODBYE, {})
            self.conn.close(GOODBYE_LINGER if queued else 0.0)
        self.conn = self.heartbeat = None

    def close(self) -> None:
        """Say goodbye and shut everything (close(), the finalizer, exit)."""
        copier, self.copier = self.copier, None
        if copier is not None:
            copier.close()
        self.detach(goodbye=True)


def weak_method(session, method: str, gone):
    """``session.method`` as a callable that holds the session weakly (``gone`` once the
    session has been collected)."""
    ref = weakref.ref(session)

    def call():
        target = ref()
        return gone if target is None else getattr(target, method)()

    return call
