"""mlx_lm.server's classes as ``expertd serve`` extends them: the model provider that serves the
one streamed model, the response generator that counts and watches the daemon, and the handler
(/metrics, OpenAI-shaped errors, refusals). Importing this module imports mlx and mlx_lm.server
and puts expertd's batch and single-request loops under mlx_lm.server's names; serve.py imports
it only once a model is to be served, so that ``expertd serve --help`` and the CLI stay light.
This module and serve.py are the only ones relying on mlx_lm.server's private surface
(``ModelProvider._load`` and its attributes, ``ResponseGenerator``, ``APIHandler``).
"""

import dataclasses
import json
import logging
import threading
import time
from queue import Empty as QueueEmpty

import mlx_lm.server
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.server import APIHandler, ModelProvider, ResponseGenerator

from expertd.client.batch import StreamedBatchGenerator
from expertd.client.decode import stream_generate
from expertd.client.serve_auth import authorized, route
from expertd.client.serve_errors import (
    DaemonWatch,
    ModelNotServed,
    RequestRefused,
    ServerStopping,
    ShapedErrors,
    abandon,
    error_object,
    unsupported,
)
from expertd.client.serve_metrics import ServerCounters
from expertd.errors import DaemonNotRunning

PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
AWAIT_SLICE = 0.1  # how often a request waiting for its tokens checks that the daemon serves
GENERATION_STOP_TIMEOUT = 3.0  # shutdown waits this long for the generation thread
# mlx_lm.server's completion endpoints: a POST to another path is no completion request.
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions", "/chat/completions")
# mlx_lm.server's attribute names in its validation messages, by the request's key.
MLX_PARAMS = {"requested_model": "model", "adapter": "adapters", "max_tokens": "max_tokens"}

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

    def begin(self) -> None:
        """A request reaches this handler thread: none of it is counted yet."""
        self._local.arrived = False

    def arrived(self) -> bool:
        """This thread's request reached :meth:`generate` (which counts it)."""
        return getattr(self._local, "arrived", False)

    def generate(self, request, generation_args, progress_callback=None):
        self._local.arrived = True
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
            elif isinstance(failure, ServerStopping):  # shut down while it was queued
                status_code, code = 503, "server_shutting_down"
            elif isinstance(failure, ModelNotServed):
                code, self._param = "model_not_found", "model"
            elif isinstance(failure, ValueError):  # the provider's: adapters, a draft model
                status_code = 400
                said = str(failure)
                self._param = ("adapters" if said.startswith("adapters") else "draft_model"
                               if said.startswith("draft model") else None)
            elif failure is not None:  # the generation thread died, or a bug of ours: not
                status_code = 500  # the caller's "not found"
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
        tools = body.get("tools")
        if tools is not None and not (isinstance(tools, list)
                                      and all(isinstance(t, dict) for t in tools)):
            raise RequestRefused("tools", "tools must be a list of objects (OpenAI's tool "
                                 "definitions)")
        tokenizer = self.response_generator.model_provider.streamed[1]
        if body.get("tools") and not getattr(tokenizer, "has_chat_template", False):
            # mlx-lm joins the messages as plain text for a model without a chat template,
            # and its tools would vanish without a word
            raise RequestRefused("tools", "tools need the model's chat template, and this "
                                 "model has none: leave tools out, or start expertd serve "
                                 "with --chat-template TEMPLATE (a template that renders "
                                 "tools)")

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
        self.response_generator.settle()  # ended: counted before the client hears of it
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

    def send_response(self, code, message=None):
        """The status line, queued. A completion request refused before it reached the
        generator (a body that is no JSON, a parameter refused, no key, the daemon gone)
        counts as a request and an error here, before its reply can reach the client, so
        that a /metrics read after the reply counts it (the generator counts the others)."""
        if (code >= 400 and self.command == "POST" and getattr(self, "_status", None) is None
                and route(self) in COMPLETION_PATHS and not self.response_generator.arrived()):
            self.server.counters.add(requests=1, errors=1)
        self._status = code
        super().send_response(code, message)

    def do_POST(self):
        """mlx-lm's POST (refusals counted as :meth:`send_response` says)."""
        self._status = None
        self.response_generator.begin()
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



