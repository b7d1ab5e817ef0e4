"""``expertd serve``: mlx-lm's OpenAI-compatible server, with its model streamed through expertd.

mlx_lm.server's request handling, chat templates, sampling, batching, prompt cache and streaming
are used as they are. What differs: the model comes from ``expertd.client.load`` (a
ModelProvider that serves it and refuses any other name), ``/metrics`` is added, errors have
OpenAI's shape, requests are answered 503 at once while the daemon is gone (the model waits for
it to come back), and the HTTP server is bound here, so that ``--port 0`` reports the real port
and SIGTERM closes the session (a goodbye to the daemon). This module is the only one that
relies on mlx_lm.server's private surface (``ModelProvider._load`` and its attributes,
``ResponseGenerator``, ``APIHandler``); pyproject.toml pins mlx-lm to the range it was written
against.
"""

import argparse
import dataclasses
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
from expertd.client.serve_errors import (
    DaemonWatch,
    ModelNotServed,
    RequestRefused,
    ServerStopping,
    ShapedErrors,
    abandon,
    authorized,
    error_object,
    route,
    unsupported,
)
from expertd.client.serve_metrics import ServerCounters, render_metrics
from expertd.client.session import check_served
from expertd.connection import Connection
from expertd.errors import DaemonError, DaemonNotRunning, FlagError
from expertd.paths import daemon_paths
from expertd.protocol import Op

METRICS_STATS_TIMEOUT = 2.0  # seconds a scrape waits for the daemon's STATS
PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# The model waits this long for a restarted daemon; requests meanwhile get 503 at once.
RECONNECT_TIMEOUT = 24 * 3600.0
AWAIT_SLICE = 0.1  # how often a request waiting for its tokens checks that the daemon serves
GENERATION_STOP_TIMEOUT = 3.0  # shutdown waits this long for the generation thread
STOP_GRACE = 5.0  # shutdown waits this long for requests in flight to send their error
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports a process that SIGINT ended
# mlx_lm.server's attribute names in its validation messages, by the request's key.
MLX_PARAMS = {"requested_model": "model", "adapter": "adapters", "max_tokens": "max_tokens"}


def model_names(blob_dir: Path) -> tuple[str, set]:
    """The id this server lists for ``blob_dir`` (the directory's name), and every name a
    request may use for it: that id, the path as given or resolved, and "default_model"."""
    name = blob_dir.resolve().name  # "." has no name of its own
    return name, {name, str(blob_dir), str(blob_dir.resolve()), "default_model"}


def _server_classes():
    """mlx_lm.server's classes, extended; built on first use so that importing this module
    does not import mlx."""
    from queue import Empty as QueueEmpty

    import mlx_lm.server
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.server import APIHandler, ModelProvider, ResponseGenerator

    from expertd.client.batch import StreamedBatchGenerator
    from expertd.client.decode import stream_generate

    # mlx_lm.server builds its batches (one request's, and many's) and runs a request no batch
    # takes (a seed, a draft model) by these names: a streamed model's steps are then launched
    # before the last is checked (client/batch.py, client/decode.py). For another model, or
    # what those loops do not do, they are mlx-lm's own; this process serves only ours.
    mlx_lm.server.BatchGenerator = StreamedBatchGenerator
    mlx_lm.server.stream_generate = stream_generate

    class StreamedModelProvider(ModelProvider):
        """Serves the one model loaded through expertd under its names; never loads another."""

        def __init__(self, cli_args, model, tokenizer, names: set, draft=None):
            super().__init__(cli_args)
            self.streamed, self.names, self.draft = (model, tokenizer), names, draft

        def load(self, model_path, adapter_path=None, draft_model_path=None):
            if model_path not in self.names:
                raise ModelNotServed(f"model {model_path!r} is not served here; this server "
                                     f"serves {self.cli_args.model_id!r} (GET /v1/models "
                                     "lists it)")
            if adapter_path not in (None, self.cli_args.adapter_path):
                raise ValueError(f"adapters {adapter_path!r} are not loaded here; start "
                                 "expertd serve with --adapter-path for them")
            if draft_model_path not in (None, "default_model", self.cli_args.draft_model):
                raise ValueError(f"draft model {draft_model_path!r} is not loaded here; "
                                 "start expertd serve with --draft-model for one")
            if self.model is None:
                self._load(model_path)
            return self.model, self.tokenizer

        def _load(self, model_path, adapter_path=None, draft_model_path=None):
            model, tokenizer = self.streamed
            self.model_key = (self.cli_args.model, None, None)
            self.model, self.tokenizer = model, tokenizer
            self.processor = None
            self.draft_model = self.draft
            self.is_batchable = self.draft is None and all(
                hasattr(c, "merge") for c in make_prompt_cache(model))

    class CountingResponseGenerator(ResponseGenerator):
        """mlx-lm's generator, counting requests and tokens on their way to the handler, and
        giving up on a request whose daemon is gone rather than waiting with the model."""

        def __init__(self, provider, prompt_cache, counters: ServerCounters,
                     watch: DaemonWatch):
            self.counters, self.watch = counters, watch
            self.stopping = threading.Event()  # set at shutdown: requests end with an error
            self._local = threading.local()  # the handler thread's request: Flight, failure
            super().__init__(provider, prompt_cache)

        def generate(self, request, generation_args, progress_callback=None):
            flight = self._local.flight = self.counters.arrived()
            self._local.failure = None
            try:
                ctx, responses = super().generate(request, generation_args, progress_callback)
            except Exception as exc:
                self._local.failure = exc
                self.counters.refused(flight)
                raise
            self.counters.admitted(flight, len(ctx.prompt))
            return ctx, self._counted(ctx, flight, responses, generation_args.stop_words)

        def _counted(self, ctx, flight, responses, stop_words):
            text = ""
            for response in responses:
                flight.last = time.perf_counter()
                if flight.first is None:
                    flight.first = flight.last
                    flight.prompt_computed = len(ctx.prompt) - max(0, ctx.prompt_cache_count)
                flight.tokens += 1
                if stop_words and response.finish_reason != "stop":
                    # mlx_lm.server stops only where the tokens spell a stop word, and strips
                    # the word from the text elsewhere but keeps generating: as OpenAI does,
                    # the text's first stop word ends the request, its text kept up to the
                    # word. This token goes out with its text before the word and no finish
                    # reason (the handler's default is "stop"; a "stop" response's own text
                    # is dropped); what earlier tokens sent of a word they began stays sent.
                    sent = len(text)
                    text += response.text
                    cut = min((at for at in (text.find(w) for w in stop_words) if at >= 0),
                              default=-1)
                    if cut >= 0:
                        ctx.stop()
                        yield dataclasses.replace(response, text=text[sent:max(sent, cut)],
                                                  finish_reason=None)
                        return
                yield response

        def failure(self) -> Exception | None:
            """What this thread's last generate() raised."""
            return getattr(self._local, "failure", None)

        def settle(self) -> None:
            """Count this thread's request as ended (the handler's last word on it)."""
            flight, self._local.flight = getattr(self._local, "flight", None), None
            if flight is not None:
                self.counters.settle(flight)

        def _await_response(self, response_queue):
            # mlx-lm's wait, which also gives up once the daemon is gone: the model, waiting
            # for the daemon to come back, would not answer until then.
            while True:
                if self.stopping.is_set():
                    abandon(response_queue, lambda: self.counters.add(abandoned=1))
                    raise ServerStopping("expertd serve is shutting down (Ctrl-C or SIGTERM); "
                                         "this request was not finished")
                try:
                    return response_queue.get(timeout=AWAIT_SLICE)
                except QueueEmpty:
                    if not self.generation_available():
                        raise RuntimeError("generation thread died") from None
                    if not self.watch.serving():
                        abandon(response_queue, lambda: self.counters.add(abandoned=1))
                        raise DaemonNotRunning(self.watch.refusal()) from None

        def stop_and_join(self):
            # Bounded: the generation thread may be waiting for a daemon that is gone.
            self._stop = True
            self._generation_thread.join(GENERATION_STOP_TIMEOUT)

    class ExpertdHandler(APIHandler):
        """mlx-lm's handler; /v1/models lists the streamed model, /metrics is added, errors
        are OpenAI-shaped, and nothing waits for a daemon that is gone."""

        def setup(self):
            super().setup()
            self.wfile = ShapedErrors(self.wfile)

        def _set_completion_headers(self, status_code: int = 200):
            code = None
            if status_code == 404:  # mlx-lm's answer to whatever generate() raised
                failure = self.response_generator.failure()
                if isinstance(failure, DaemonNotRunning):
                    status_code = 503
                    self.server.counters.add(daemon_refusals=1)
                elif isinstance(failure, ModelNotServed):
                    code, self._param = "model_not_found", "model"
            self._error = ((status_code, code, getattr(self, "_param", None))
                           if status_code >= 400 else None)
            super()._set_completion_headers(status_code)

        def end_headers(self):
            super().end_headers()
            # mlx-lm writes an error's body right after its headers.
            self.wfile.pending, self._error = getattr(self, "_error", None), None

        def validate_model_parameters(self):
            """mlx-lm's checks, then what mlx_lm.server 0.32 gets wrong, refused in OpenAI's
            shape with the parameter named: more than one choice, messages that are not a
            list of objects, a prompt that is not text. A request naming no model is answered
            with the served model's id (not "default_model")."""
            self._param = None
            try:
                super().validate_model_parameters()
                self._check_body()
            except RequestRefused as exc:
                self._param = exc.param
                raise
            except ValueError as exc:  # mlx-lm's: "<attribute> must be ..."
                name = str(exc).split(" ", 1)[0]
                self._param = MLX_PARAMS.get(name, name if name in self.body else None)
                if self._param and self._param != name:  # said with the request's own key
                    raise ValueError(self._param + str(exc)[len(name):]) from None
                raise
            if self.body.get("model", "default_model") == "default_model" and \
                    not self.response_generator.cli_args.pipeline:
                # (A pipeline's ranks know the model as "default_model": each stage has its
                # own directory's name.)
                self.requested_model = self.response_generator.cli_args.model_id

        def _check_body(self):
            body = self.body
            n = body.get("n", 1)
            if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n != 1):
                raise RequestRefused("n", f"n must be 1 here, not {n!r}: this server returns "
                                     "one choice a request (send the request again for more)")
            stop = body.get("stop")
            if stop is not None and not ((isinstance(stop, str) and stop) or (
                    isinstance(stop, list) and all(isinstance(w, str) and w for w in stop))):
                raise RequestRefused("stop", "stop must be a non-empty string or a list of "
                                     "non-empty strings")
            if self.path.endswith("/chat/completions"):
                messages = body.get("messages")
                if not (isinstance(messages, list) and messages
                        and all(isinstance(m, dict) and "role" in m for m in messages)):
                    raise RequestRefused("messages", "messages must be a non-empty list of "
                                         "objects, each with a role and its content")
            elif not isinstance(body.get("prompt"), str) or not body["prompt"]:
                # (mlx-lm's batch raised on an empty one, on its generation thread, which then
                # died for every request)
                raise RequestRefused("prompt", "prompt must be a non-empty string")
            refused = unsupported(body, self.path.endswith("/chat/completions"))
            if refused is not None:  # what it would otherwise ignore
                raise refused

        def handle_completion(self, request, stop_words):
            if not self.server.daemon_serves():
                self.server.counters.add(daemon_refusals=1)
                self._send_error(503, self.server.refusal())
                return
            try:
                super().handle_completion(request, stop_words)
            except DaemonNotRunning as exc:  # gone while this request waited for tokens
                self.server.counters.add(daemon_refusals=1)
                self._fail_midway(503, str(exc))
            except ServerStopping as exc:
                self._fail_midway(503, str(exc), "server_shutting_down")
            except ConnectionError:
                raise  # the client hung up: ExpertdHTTPServer.handle_error counts it
            except Exception as exc:  # generation failed once the request was taken
                logging.error("expertd serve: generation failed: %s", exc)
                self._fail_midway(500, f"generation failed: {exc}")
            finally:
                self.response_generator.settle()

        def _fail_midway(self, status: int, message: str, code: str | None = None) -> None:
            if self.stream:  # the 200 is sent: end the stream with an error event
                body = json.dumps(error_object(status, message, code))
                self.wfile.write(f"data: {body}\n\n".encode())
                self.wfile.flush()
            else:
                self._headers_buffer = []  # the 200 that mlx-lm queued is not sent yet
                self._send_error(status, message, code)

        def handle_health_check(self):
            if self.server.daemon_serves():
                super().handle_health_check()
            else:
                body = {"status": "unavailable", **error_object(503, self.server.refusal())}
                self._send(503, "application/json", json.dumps(body).encode())

        def do_POST(self):
            if authorized(self, self.server.api_key, self._set_cors_headers):
                super().do_POST()

        def do_GET(self):
            if not authorized(self, self.server.api_key, self._set_cors_headers):
                return
            path = route(self)
            if path == "/metrics":
                self._send(200, PROMETHEUS_TYPE, self.server.metrics().encode())
            elif path == "/v1/models" or path.startswith("/v1/models/"):
                self._models(path)
            elif path == "/health":
                self.handle_health_check()
            else:  # never mlx_lm.server's own GET: it lists a Hugging Face cache's models
                self._send_error(404, f"no such endpoint: GET {path}", "not_found")

        def do_HEAD(self):
            """/health's status alone (a load balancer's probe); other paths: 405."""
            if not authorized(self, self.server.api_key, self._set_cors_headers):
                return
            ok = route(self) == "/health"
            self.send_response((200 if self.server.daemon_serves() else 503) if ok else 405)
            self._set_cors_headers()
            self.end_headers()

        def _models(self, path: str):
            name = self.response_generator.cli_args.model_id
            entry = {"id": name, "object": "model", "created": self.server.created,
                     "owned_by": "expertd"}
            wanted = path[len("/v1/models/"):]
            if not wanted:
                body = {"object": "list", "data": [entry]}
            elif wanted in self.server.names:
                body = entry
            else:
                self._send_error(404, f"model {wanted!r} is not served here; this server "
                                 f"serves {name!r}", "model_not_found")
                return
            self._send(200, "application/json", json.dumps(body).encode())

        def _send_error(self, status: int, message: str, code: str | None = None) -> None:
            body = json.dumps(error_object(status, message, code)).encode()
            self._send(status, "application/json", body)

        def _send(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self._set_cors_headers()
            self.end_headers()
            self.wfile.write(body)

    return StreamedModelProvider, CountingResponseGenerator, ExpertdHandler


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
        return self.session is not None and self.session.unanswered()

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
            KEY``; serve_errors.read_api_key), or None: whoever reaches the port may use it.
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
        tokenizer.chat_template = tokenizer.default_chat_template
    provider_class, generator_class, handler_class = _server_classes()
    provider = provider_class(cli_args, model, tokenizer, names,
                              draft[0] if draft is not None else None)
    counters, watch = ServerCounters(), DaemonWatch(session.paths)
    fingerprint = get_system_fingerprint()
    generator = generator_class(provider, LRUPromptCache(cli_args.prompt_cache_size),
                                counters, watch)
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
        httpd.ready(lambda *a, **k: handler_class(generator, *a, system_fingerprint=fingerprint,
                                                  **k),
                    session=session, counters=counters, names=names, watch=watch)
        print(f"expertd serve: {name} on {_url(httpd)}/v1 (blob dir {session.paths.blob_dir}, "
              f"daemon pid {session.daemon_pid}); {_access(httpd)}; stop with Ctrl-C",
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
