"""``expertd serve``: mlx-lm's OpenAI-compatible server, with its model streamed through expertd.

mlx_lm.server's request handling, chat templates, sampling, batching, prompt cache and streaming
are used as they are. What differs: the model comes from ``expertd.client.load`` (a
ModelProvider that serves it and refuses any other name), ``/metrics`` is added, errors have
OpenAI's shape, requests are answered 503 at once while the daemon is gone (the model waits for
it to come back), and the HTTP server is bound here, so that ``--port 0`` reports the real port
and SIGTERM closes the session (a goodbye to the daemon). mlx_lm.server's classes, extended,
are in serve_http.py; this module is the process: binding, loading, signals and shutdown. The
two are the only ones relying on mlx_lm.server's private surface; pyproject.toml pins mlx-lm to
the range they were written against.

One job, over 400 lines: the serving process's life.
"""

import argparse
import errno
import functools
import ipaddress
import json
import logging
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from expertd.choices import MLX_SERVER_DEFAULTS
from expertd.client.serve_auth import authorized, route
from expertd.client.serve_errors import (
    DaemonWatch,
    error_object,
)
from expertd.client.serve_metrics import ServerCounters, render_metrics
from expertd.client.session import check_served
from expertd.connection import Connection
from expertd.errors import DaemonError, FlagError
from expertd.paths import daemon_paths
from expertd.protocol import Op

METRICS_STATS_TIMEOUT = 2.0  # seconds a scrape waits for the daemon's STATS
# The model waits this long for a restarted daemon; requests meanwhile get 503 at once.
RECONNECT_TIMEOUT = 24 * 3600.0
STOP_GRACE = 5.0  # shutdown waits this long for requests in flight to send their error
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports a process that SIGINT ended


def model_names(blob_dir: Path) -> tuple[str, set]:
    """The id this server lists for ``blob_dir`` (the directory's name), and every name a
    request may use for it: that id, the path as given or resolved, and "default_model"."""
    name = blob_dir.resolve().name  # "." has no name of its own
    return name, {name, str(blob_dir), str(blob_dir.resolve()), "default_model"}


class ExpertdHTTPServer(ThreadingHTTPServer):
    """The HTTP server, holding what /metrics and /v1/models need to know."""

    daemon_threads = True  # a client holding a stream open must not keep the process alive

    def __init__(self, address, handler, blob_dir: Path, cli_args: argparse.Namespace):
        super().__init__(address, handler)
        self.blob_dir, self.cli_args = blob_dir, cli_args  # mlx_lm.server's settings
        self.api_key = getattr(cli_args, "api_key", None)  # what requests must bear, or None
        # The model's "created" in /v1/models: one time, the server's start (mlx-lm's handler
        # took its own request's, so two listings a second apart differed)
        self.created = int(time.time())
        self.session = self.counters = self.names = self.watch = None  # set by ready()
        self._down = False  # the last look found no daemon (see daemon_serves)

    def ready(self, handler, *, session, counters: ServerCounters, names: set,
              watch: DaemonWatch) -> None:
        """The model is loaded: requests from now on are served by ``handler``."""
        self.session, self.counters, self.names, self.watch = session, counters, names, watch
        self.RequestHandlerClass = handler

    def daemon_serves(self) -> bool:
        """Whether a daemon serves the blob directory now and answers (one that holds its
        lock but has answered no heartbeat for the time-to-dead, stopped or stuck, does not:
        /health said ok while requests hung on it); the first look that finds none says so
        on stderr (requests are answered 503 until one is back), the first that finds one
        again says that."""
        serving = self.watch.serving() and not self._stuck()
        if serving == self._down:
            self._down = not serving
            logging.warning("expertd serve: %s", f"a daemon serves {self.blob_dir} again"
                            if serving else f"{self.refusal()}; requests are answered 503")
        return serving

    def refusal(self) -> str:
        """Why requests are refused now (see :meth:`daemon_serves`)."""
        if self.watch.serving() and self._stuck():
            return (f"the expertd serving {self.blob_dir} does not answer (stopped, or "
                    f"stuck?); restart it with: expertd restart --blobs {self.blob_dir}")
        return self.watch.refusal()

    def _stuck(self) -> bool:
        """The session's daemon holds its lock but does not answer (Session.unanswered)."""
        return self.session is not None and self.session.session.unanswered()

    def handle_error(self, request, client_address):
        # A client that hangs up before its reply is written is no error of the server's.
        if isinstance(sys.exc_info()[1], ConnectionError):
            self.counters.add(disconnects=1)
        else:
            super().handle_error(request, client_address)

    def metrics(self) -> str:
        """The Prometheus text exposition of the daemon's counters and this server's."""
        return render_metrics(self._daemon_stats(), self.counters, self.session.all_counters(),
                              self.session.pool_bytes, self.session.manifest.stride)

    def _daemon_stats(self) -> dict | None:
        # Its own socket: the session's belongs to the generation thread.
        if not self.watch.serving():
            return None
        try:
            with Connection(self.blob_dir) as conn:
                return conn.request(Op.STATS, timeout=METRICS_STATS_TIMEOUT)
        except DaemonError:
            return None


def mlx_server_args(blob_dir: Path, options: dict) -> argparse.Namespace:
    """The namespace mlx_lm.server reads its settings from: its defaults, then ``options``."""
    unknown = set(options) - set(MLX_SERVER_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown mlx_lm.server options: {', '.join(sorted(unknown))}")
    name, _ = model_names(blob_dir)
    return argparse.Namespace(**{**MLX_SERVER_DEFAULTS, **options}, model=str(blob_dir),
                              model_id=name)


class LoadingHandler(BaseHTTPRequestHandler):
    """Every request while the model loads: 503, ``{"status": "loading"}`` on /health (as
    llama-server answers), an OpenAI error body elsewhere; HEAD the same without the body, and
    OPTIONS (a browser's preflight) 204. With mlx_lm.server's CORS headers, as once loaded."""

    @property
    def response_generator(self):
        """What mlx_lm.server's CORS headers read their ``cli_args`` from: the server."""
        return self.server

    def _set_cors_headers(self) -> None:
        from mlx_lm.server import APIHandler  # imported already, before listening (serve())

        APIHandler._set_cors_headers(self)  # mlx_lm.server's own, as once loaded

    def do_GET(self, body: bool = True):
        if not authorized(self, self.server.api_key, self._set_cors_headers):
            return
        reply = ({"status": "loading"} if route(self) == "/health" else
                 error_object(503, "expertd serve is loading its model; try again shortly",
                              "model_loading"))
        data = json.dumps(reply).encode()
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Retry-After", "1")
        self._set_cors_headers()
        self.end_headers()
        if body:
            self.wfile.write(data)

    def do_POST(self):
        self.do_GET()

    def do_HEAD(self):
        self.do_GET(body=False)

    def do_OPTIONS(self):
        self.send_response(204)
        self._set_cors_headers()
        self.end_headers()

    def log_message(self, format, *args):  # quiet, as mlx_lm.server's --log-level WARNING
        pass


def _bind(host: str, port: int, blob_dir: Path, cli_args) -> ExpertdHTTPServer:
    """Listen on ``host:port`` (IPv4 or IPv6, as mlx_lm.server resolves it), answering
    :class:`LoadingHandler` until :meth:`ExpertdHTTPServer.ready`."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
        server_class = type("Server", (ExpertdHTTPServer,), {"address_family": family})
        return server_class(address, LoadingHandler, blob_dir, cli_args)
    except socket.gaierror as exc:
        if exc.errno == socket.EAI_AGAIN:  # the resolver failed for now: not the flag's fault
            raise OSError(f"cannot resolve {host} now ({exc.strerror or exc}); try again, or "
                          "give --host an address (127.0.0.1, ::1, 0.0.0.0)") from None
        raise FlagError(f"--host {host}: not an address or a name this machine resolves "
                        f"({exc.strerror or exc}); e.g. 127.0.0.1, ::1 or 0.0.0.0") from None
    except OSError as exc:
        if exc.errno == errno.EADDRNOTAVAIL:
            advice = f"{host} is not an address of this machine; give one of its own with --host"
        elif exc.errno == errno.EACCES:
            advice = f"port {port} is privileged here; pick one from 1024 up with --port"
        else:
            advice = "pick another --port or stop what uses it"
        raise OSError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); "
                      f"{advice}") from None


def serve(blob_dir, host: str = "127.0.0.1", port: int = 8080, prefetch: str = "auto",
          pool_gb: float | None = None, speculate: str = "auto", pull: str = "auto",
          reconnect_timeout: float | None = None,
          options: dict | None = None, out=sys.stdout, pipeline_group=None,
          adapter_path: str | None = None, trust_remote_code: bool = False,
          api_key: str | None = None) -> int:
    """Serve the model of ``blob_dir`` over HTTP until SIGINT or SIGTERM.

    Args:
        blob_dir: a blob directory served by a running daemon.
        host, port: where to listen (port 0: any free port; the line printed names it).
        prefetch: the client's prefetch mode (see ``expertd.client.load``).
        pool_gb: the client's expert pools (see ``expertd.client.load``).
        speculate: one host wait per decode step (see ``expertd.client.load``).
        api_key: the key every request but /health must bear (``Authorization: Bearer
            KEY``; serve_auth.read_api_key), or None: whoever reaches the port may use it.
        options: mlx_lm.server settings by their argparse names (``temp``, ``max_tokens``,
            ``chat_template``, ...); the rest keep mlx_lm.server's defaults.
        out: where the "listening" line goes.
        pipeline_group: under mlx.launch, the ranks' group: this process runs its pipeline
            stage; rank 0 answers HTTP and shares each request with the others (mlx_lm.server's
            own distributed mode), the other ranks compute their stage until SIGINT or SIGTERM.
    Returns:
        0 after SIGTERM, 130 after Ctrl-C (SIGINT); either way requests in flight end with
        an error (a stream with an error event) and the session closes with a goodbye.
    Raises:
        DaemonNotRunning: no daemon serves ``blob_dir`` (the message says how to start one).
        OSError: the address cannot be bound.
        FlagError: ``host`` is no address or name this machine resolves.
        ValueError: an unknown option.
    """
    from expertd.client import load

    blob_dir = Path(blob_dir).expanduser()
    cli_args = mlx_server_args(blob_dir, options or {})
    cli_args.adapter_path = adapter_path  # loaded with the model (a request may name them)
    cli_args.trust_remote_code = trust_remote_code
    cli_args.api_key = api_key
    # The command line has configured logging already (then this only sets the level).
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(message)s")
    root = logging.getLogger()  # `expertd -v serve` keeps its debug lines
    root.setLevel(min(root.level or logging.WARNING, logging.getLevelName(
        cli_args.log_level.upper())))
    draft = None
    if cli_args.draft_model:  # before the model: a bad draft costs no daemon attach
        if pipeline_group is not None:
            raise FlagError("--draft-model does not go with --pipeline: mlx-lm's speculative "
                            "decoding runs in one process")
        from expertd.client.generate import load_draft

        draft = load_draft(cli_args.draft_model)  # (model, tokenizer)
    name, names = model_names(blob_dir)
    distributed = pipeline_group is not None
    httpd = loading = None
    check_served(daemon_paths(blob_dir))  # a one-line error before listening
    if not distributed:
        # Listening at once: /health answers 503 {"status": "loading"} until the model is
        # ready (a load waits for the daemon's answers, and a large trunk takes a while). A
        # pipeline's rank 0 listens once every rank has loaded (mlx-lm's distributed server).
        # mlx_lm.server (which the loading handler's CORS headers come from) is imported here,
        # before anything answers: imported by the HTTP thread while this one imports mlx-lm
        # to load the model, it failed half-initialized ("cannot import name ... from
        # partially initialized module") and serve died at the README's first /health poll.
        import mlx_lm.server  # noqa: F401

        httpd = _bind(host, port, blob_dir, cli_args)
        loading = threading.Thread(target=httpd.serve_forever, name="expertd-serve-loading",
                                   daemon=True)
        loading.start()
        print(f"expertd serve (loading {name}): {_url(httpd)}/health answers 503 until the "
              "model is ready", file=out, flush=True)
    signum = None
    # SIGTERM while loading ends it as Ctrl-C does, but as a clean stop (unless it was ignored
    # when serve started: it stays ignored).
    if not distributed and signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN:
        signal.signal(signal.SIGTERM, _terminated)
    try:
        # A daemon that dies later is waited for by the model, not by the requests (see
        # DaemonWatch): a server outlives daemon restarts.
        try:
            wait = RECONNECT_TIMEOUT if reconnect_timeout is None else reconnect_timeout
            model, tokenizer = load(blob_dir, prefetch=prefetch, pipeline_group=pipeline_group,
                                    pool_gb=pool_gb, speculate=speculate, pull=pull,
                                    reconnect_timeout=wait, adapter_path=adapter_path,
                                    trust_remote_code=trust_remote_code,
                                    decode_concurrency=cli_args.decode_concurrency)
        except Terminated:
            return 0
        cli_args.pipeline = distributed
        session = model.expertd_session
        try:
            signum = _serve_loaded(httpd, loading, functools.partial(
                _bind, host, port, blob_dir, cli_args), session,
                                   model, tokenizer, draft, cli_args, name, names,
                                   pipeline_group, out)
        finally:
            session.close()
    finally:
        if httpd is not None:
            _stop_loading(httpd, loading)
            httpd.server_close()
    return EXIT_INTERRUPTED if signum == signal.SIGINT else 0


class Terminated(BaseException):
    """SIGTERM arrived while the model loaded."""


def _terminated(signum, frame):
    raise Terminated


def _url(httpd) -> str:
    host, port = httpd.server_address[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"  # IPv6 in brackets


def _access(httpd) -> str:
    """Who may use the server, in a few words for its ready line."""
    if httpd.api_key is not None:
        return "requests need its API key"
    host = httpd.server_address[0]
    try:
        local = ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        local = False
    return ("no API key: every user of this machine may use it" if local else
            "no API key: whoever reaches this port may use it (--api-key-file)")


def _stop_loading(httpd, loading) -> None:
    """End the loop that answered while the model loaded (the socket keeps listening)."""
    if loading is not None and loading.is_alive():
        httpd.shutdown()
        loading.join()


def _serve_loaded(httpd, loading, listen, session, model, tokenizer, draft, cli_args, name,
                  names, pipeline_group, out) -> int | None:
    """Serve the loaded model until a signal; the signal's number (None on a pipeline rank,
    which a signal ends in the kernel). ``httpd`` listens already (``loading`` answers on it),
    or ``listen()`` makes it (a pipeline's rank 0)."""
    from mlx_lm.models.cache import LRUPromptCache
    from mlx_lm.server import get_system_fingerprint

    if draft is not None:
        from expertd.client.generate import check_draft

        check_draft(draft, tokenizer, cli_args.draft_model)
    if cli_args.chat_template:
        tokenizer.chat_template = cli_args.chat_template  # as mlx_lm.server's load does
        tokenizer.has_chat_template = True
    elif cli_args.use_default_chat_template and tokenizer.chat_template is None:
        # (mlx_lm.server's own read raises: the tokenizers library gives no default now)
        default = getattr(tokenizer, "default_chat_template", None)
        if default is None:
            raise FlagError("--use-default-chat-template: this model's tokenizer has no "
                            "default chat template; give one with --chat-template TEMPLATE")
        tokenizer.chat_template, tokenizer.has_chat_template = default, True
    from expertd.client import serve_http  # mlx_lm.server's classes, extended

    provider = serve_http.StreamedModelProvider(cli_args, model, tokenizer, names,
                                                draft[0] if draft is not None else None)
    counters, watch = ServerCounters(), DaemonWatch(session.paths)
    fingerprint = get_system_fingerprint()
    generator = serve_http.CountingResponseGenerator(
        provider, LRUPromptCache(cli_args.prompt_cache_size), counters, watch)
    distributed = pipeline_group is not None
    if distributed:
        # Every rank's generation thread shares the requests with the others (mlx-lm does),
        # waiting inside MLX with the GIL held (an .item() on a collective): a Python signal
        # handler would run only once the other ranks answer, and they may be gone. So
        # Ctrl-C or SIGTERM ends a rank in the kernel; the daemon forgets a client whose
        # connection closes, and nothing else here needs closing.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if pipeline_group.rank() != 0:  # it follows rank 0's requests
            while True:
                signal.pause()
    try:
        if httpd is None:  # a pipeline's rank 0: listens once every rank has loaded
            httpd = listen()
        _stop_loading(httpd, loading)
        httpd.ready(lambda *a, **k: serve_http.ExpertdHandler(
            generator, *a, system_fingerprint=fingerprint, **k),
                    session=session, counters=counters, names=names, watch=watch)
        print(f"expertd serve: {name} on {_url(httpd)}/v1 (blob dir {session.paths.blob_dir}, "
              f"daemon pid {session.session.daemon_pid}); {_access(httpd)}; stop with Ctrl-C",
              file=out, flush=True)
        if distributed:
            httpd.serve_forever()  # until a signal ends the process
            return None
        signum = _serve_until_signal(httpd)
        # A second Ctrl-C must not cut the shutdown short (the generation thread still runs).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # Requests in flight end with an error (a stream with an error event), not cut off.
        generator.stopping.set()
        counters.wait_idle(STOP_GRACE)
        return signum
    finally:
        if not distributed:
            generator.stop_and_join()


def _serve_until_signal(httpd) -> int:
    """Serve ``httpd`` until SIGINT or SIGTERM, either of which ends ``serve_forever`` in this
    thread; the signal's number. Only the first signal ends it: one that follows (a second
    Ctrl-C) is ignored from then on, so it never interrupts the shutdown that the caller does
    next (it did, between two signals sent back to back, and the generation thread was then
    joined without being told to stop)."""
    caught = []

    def interrupt(signum, frame):
        if not caught:
            caught.append(signum)
            raise KeyboardInterrupt

    for signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(signum) is not signal.SIG_IGN:  # ignored when started so: stays
            signal.signal(signum, interrupt)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    return caught[0] if caught else signal.SIGINT
