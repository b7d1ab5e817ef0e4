"""What ``expertd serve`` answers when something is wrong: OpenAI-shaped error bodies, and
whether the daemon serves at all (a request is refused at once rather than left waiting)."""

import json

from expertd.runfile import serving_epoch

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
