"""What ``expertd serve`` answers when something is wrong: OpenAI-shaped error bodies, and
whether the daemon serves at all (a request is refused at once rather than left waiting)."""

import json

from expertd.runfile import serving_epoch

# The "code" of an error body, by HTTP status, where no finer one applies.
ERROR_CODES = {400: "invalid_request", 404: "not_found", 411: "length_required",
               500: "internal_error", 503: "daemon_unavailable"}


class ModelNotServed(ValueError):
    """A request named a model this server does not serve."""


def error_object(status: int, message: str, code: str | None = None) -> dict:
    """The OpenAI error body, ``{"error": {"message", "type", "code"}}``."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind,
                      "code": code or ERROR_CODES.get(status, "error")}}


class DaemonWatch:
    """Whether a daemon serves the blob directory now: its lock held and its run file ready,
    the way a client tells a dead daemon (runfile.serving_epoch); a few syscalls."""

    def __init__(self, paths):
        self.paths = paths

    def serving(self) -> bool:
        return bool(serving_epoch(self.paths))

    def refusal(self) -> str:
        blob = self.paths.blob_dir
        return (f"no expertd serves {blob} now; start it with: expertd start --blobs {blob} "
                "(this server serves again once it is back)")


class ShapedErrors:
    """A handler's output that rewrites the next body, once ``pending`` is set to its
    ``(status, code)``, into an OpenAI error body: mlx_lm.server writes ``{"error": text}``
    or plain text."""

    def __init__(self, raw):
        self.raw, self.pending = raw, None

    def write(self, data: bytes):
        if self.pending is not None:
            (status, code), self.pending = self.pending, None
            try:
                message = json.loads(data)["error"]
            except (ValueError, TypeError, KeyError):
                message = None
            if not isinstance(message, str):
                message = bytes(data).decode(errors="replace").strip()
            data = json.dumps(error_object(status, message, code)).encode()
        return self.raw.write(data)

    def __getattr__(self, name):
        return getattr(self.raw, name)
