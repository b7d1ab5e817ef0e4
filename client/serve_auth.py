"""Who may use ``expertd serve``: the API key every request but /health must bear, read once
at start from a private file or the environment, and each request's check against it."""

import errno
import hmac
import json
import os
import stat
from pathlib import Path

from expertd.client.serve_errors import error_object
from expertd.errors import FlagError

API_KEY_ENV = "EXPERTD_API_KEY"  # the key, where --api-key-file is not given
MAX_KEY_FILE = 4096  # bytes: a key file's most (HTTP headers are read as latin-1: ASCII keys)


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
