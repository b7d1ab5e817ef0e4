"""What ``expertd serve`` answers when something is wrong: OpenAI-shaped error bodies, and
whether the daemon serves at all (a request is refused at once rather than left waiting)."""

import errno
import hmac
import json
import os
import stat
from pathlib import Path

from expertd.errors import FlagError
from expertd.runfile import serving_epoch

API_KEY_ENV = "EXPERTD_API_KEY"  # the key, where --api-key-file is not given
MAX_KEY_FILE = 4096  # bytes: a key file's most (HTTP headers are read as latin-1: ASCII keys)

# The "code" of an error body, by HTTP status, where no finer one applies.
ERROR_CODES = {400: "invalid_request", 401: "invalid_api_key", 404: "not_found",
               411: "length_required",
               500: "internal_error", 503: "daemon_unavailable"}


class ModelNotServed(ValueError):
    """A request named a model this server does not serve."""


class RequestRefused(ValueError):
    """A request's parameter that this server refuses (``param``: its name in the body)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


# What a request may hold. mlx_lm.server's own parameters (it reads each of them)...
_MLX_FIELDS = {"model", "stream", "stream_options", "max_tokens", "max_completion_tokens",
               "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
               "repetition_context_size", "presence_penalty", "presence_context_size",
               "frequency_penalty", "frequency_context_size", "xtc_probability",
               "xtc_threshold", "logit_bias", "logprobs", "top_logprobs", "seed", "stop", "n",
               "draft_model", "num_draft_tokens", "adapters", "chat_template_kwargs"}
_CHAT_FIELDS = _MLX_FIELDS | {"messages", "tools", "role_mapping"}
_COMPLETION_FIELDS = _MLX_FIELDS | {"prompt"}
# ... OpenAI's that change no output (bookkeeping on OpenAI's side), taken and ignored...
_BOOKKEEPING = {"user", "metadata", "store", "service_tier", "prediction"}
# ... and OpenAI's that mean something mlx_lm.server does not do: accepted at the value that
# asks for nothing (these values), refused at any other.
_INERT = {"response_format": ({"type": "text"},), "echo": (False,), "best_of": (1,),
          "suffix": ("",), "tool_choice": ("auto",), "parallel_tool_calls": (True,),
          "modalities": (["text"],)}
ROLES = ("system", "developer", "user", "assistant", "tool")


def unsupported(body: dict, chat: bool) -> "RequestRefused | None":
    """Why this server refuses a request ``body`` (a chat completion's, or a completion's)
    for holding what it would otherwise ignore (an unknown field, a response format, echo,
    best_of, a suffix, a role no template knows), as RequestRefused naming the parameter; or
    None. OpenAI refuses an unknown field too ("Unrecognized request argument")."""
    known = (_CHAT_FIELDS if chat else _COMPLETION_FIELDS) | _BOOKKEEPING
    for name, value in body.items():
        if name in _INERT:
            if value is not None and value not in _INERT[name]:
                return RequestRefused(name, f"{name}={json.dumps(value)} is not supported by "
                                      f"this server (mlx_lm.server); leave it out")
        elif name not in known:
            return RequestRefused(name, f"Unrecognized request argument supplied: {name}")
    if chat:
        for i, message in enumerate(body.get("messages") or ()):
            role = message.get("role") if isinstance(message, dict) else None
            if role not in ROLES:
                return RequestRefused(f"messages[{i}].role", f"messages[{i}].role must be one "
                                      f"of {', '.join(ROLES)}, not {role!r}")
            content = message.get("content")
            for j, part in enumerate(content if isinstance(content, list) else ()):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":  # mlx_lm.server would fetch an image's URL, for nothing
                    return RequestRefused(f"messages[{i}].content[{j}].type",
                                          f"messages[{i}].content[{j}] is {kind!r}: this "
                                          "server's model reads text parts only")
    return None


class ServerStopping(Exception):
    """The server is shutting down (Ctrl-C or SIGTERM) with this request unfinished."""


def error_object(status: int, message: str, code: str | None = None,
                 param: str | None = None) -> dict:
    """The OpenAI error body, ``{"error": {"message", "type", "param", "code"}}``."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param,
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
    ``(status, code, param)``, into an OpenAI error body: mlx_lm.server writes ``{"error": text}``
    or plain text."""

    def __init__(self, raw):
        self.raw, self.pending = raw, None

    def write(self, data: bytes):
        if self.pending is not None:
            (status, code, param), self.pending = self.pending, None
            try:
                message = json.loads(data)["error"]
            except (ValueError, TypeError, KeyError):
                message = None
            if not isinstance(message, str):
                message = bytes(data).decode(errors="replace").strip()
            data = json.dumps(error_object(status, message, code, param)).encode()
        return self.raw.write(data)

    def __getattr__(self, name):
        return getattr(self.raw, name)


def abandon(response_queue, on_stopped) -> None:
    """Nobody reads ``response_queue`` any more: its request was answered 503 while it waited.

    The request may still sit in mlx_lm.server's queue of requests, and its generation thread,
    waiting inside the model for the daemon, would generate it for nobody once the daemon is
    back. So from now on the context it hands this queue is stopped at once (its batch drops
    the request after a step) and ``on_stopped()`` called, and nothing else handed to it is
    kept.
    """
    from queue import Empty

    from mlx_lm.server import GenerationContext

    def put(item, *args, **kwargs):
        if isinstance(item, GenerationContext):
            item.stop()
            on_stopped()

    response_queue.put = put  # looked up at each put by the generation thread
    while True:  # what it put before
        try:
            item = response_queue.get_nowait()
        except Empty:
            return
        put(item)



def read_api_key(path: str | None, environ=os.environ) -> str | None:
    """The key every request but /health must bear (``Authorization: Bearer KEY``, as OpenAI's
    clients send their ``api_key``): the one line of the file ``path``, else $EXPERTD_API_KEY,
    else None (no key: whoever reaches the port uses the model, as with mlx_lm.server). Not a
    flag's value, which every user of the machine could read in the process list.

    Raises:
        ValueError: the file cannot be read, others may read it (as ssh refuses such a private
            key), or it holds no single word.
    """
    if path is None:
        key = environ.get(API_KEY_ENV)
        if key is not None and not (key.isascii() and key.split() == [key]):
            # Set but empty (a failed $(cat FILE)) would leave the server open: refused.
            raise ValueError(f"${API_KEY_ENV} must be one word of ASCII (it is set, to "
                             f"{'nothing' if not key.strip() else 'more than one word or non-ASCII'}); "
                             "unset it for a server without a key")
        return key
    file = Path(path).expanduser()
    try:
        # Not blocking: a FIFO at the path (nobody writing) would hang serve's start.
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        mode = os.fstat(fd).st_mode  # the mode of what was opened, not of a name swapped in
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise FlagError(f"--api-key-file {path}: not a regular file")
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_KEY_FILE + 1)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.EACCES, errno.EISDIR, errno.ENOTDIR):
            raise FlagError(f"--api-key-file {path}: {exc.strerror}") from None
        raise OSError(f"cannot read the API key file {path}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise FlagError(f"--api-key-file {path}: other users may read it (mode "
                        f"{stat.S_IMODE(mode):o}); chmod 600 {path}")
    words = data.split()
    if len(data) > MAX_KEY_FILE or len(words) != 1 or not words[0].isascii():
        raise FlagError(f"--api-key-file {path}: it must hold the key alone, one word of "
                        f"ASCII of at most {MAX_KEY_FILE} bytes (it holds {len(words)} "
                        f"word{'s' * (len(words) != 1)}, {len(data)} bytes)")
    return words[0].decode()


def route(handler) -> str:
    """The path a request asks for, its query left out (a query changes no route)."""
    return handler.path.split("?", 1)[0]


def authorized(handler, key: str | None, cors) -> bool:
    """Whether ``handler``'s request may be served under ``key`` (None: every request; else a
    request bearing it, or /health, which load balancers ask without one). A refused request
    is answered 401 in OpenAI's shape, with the CORS headers ``cors()`` writes, its
    connection then closed (its body is not read)."""
    if key is None or route(handler) == "/health":
        return True
    scheme, _, given = handler.headers.get("Authorization", "").strip().partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode()):
        return True
    message = ("the API key is not this server's" if scheme.lower() == "bearer" and given else
               "this server needs its API key: send the header Authorization: Bearer KEY "
               "(OpenAI clients: api_key=KEY)")
    body = json.dumps(error_object(401, message)).encode()
    handler.close_connection = True
    handler.send_response(401)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.send_header("WWW-Authenticate", "Bearer")
    handler.send_header("Connection", "close")
    cors()  # mlx_lm.server's CORS headers: a browser's script reads the 401
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(body)
    return False
