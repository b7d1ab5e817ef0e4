"""The exception hierarchy shared by the daemon, the client and the command line."""


class ExpertdError(Exception):
    """Base class: every error expertd raises on purpose."""


class FlagError(ExpertdError, ValueError):
    """A flag's value found wrong once the command knew more (the model, a file, the network):
    the message starts with the flag, and the command line exits 2, as argparse does for a value
    it refuses while parsing. A ValueError too, for the Python API's callers."""


class ModelDirError(ExpertdError):
    """The input is not a usable mlx-lm MoE model directory."""


class BlobStoreError(ExpertdError):
    """A blob directory is missing, malformed or corrupt."""


class ConvertError(ExpertdError):
    """``expertd convert`` cannot write its output (disk full, destination busy, ...)."""


class ChecksumError(BlobStoreError):
    """An expert's bytes do not match the checksum in the manifest."""

    def __init__(self, layer: int, expert: int, path: str):
        super().__init__(f"checksum mismatch for layer {layer} expert {expert} in {path}")
        self.layer = layer
        self.expert = expert


class ProtocolError(ExpertdError):
    """A message on the wire is malformed, of the wrong version or refused."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


class DaemonError(ExpertdError):
    """The daemon refused a request, is not running, or died.

    ``code`` is the protocol's error code when the daemon answered with an error, else None.
    """

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.code = code


class DaemonNotRunning(DaemonError):
    """No expertd serves the requested blob directory."""


class DaemonDied(DaemonError):
    """The daemon a client was attached to is gone: dead, shutting down, or no longer knowing
    the client. A session attaches again (to the same daemon or its successor)."""


class NoReply(DaemonError):
    """No reply came within a request's timeout (the daemon may be stopped or stuck)."""


class RemoteError(ExpertdError):
    """A remote checkpoint's bytes could not be fetched (network, server, or a wrong answer)."""
