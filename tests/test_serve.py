"""``expertd serve``: mlx_lm.server's OpenAI API on the shared cache, through the official client.

Real processes only: one daemon, two ``expertd serve`` processes on ports they pick themselves,
the ``openai`` package talking to them. Greedy answers must equal ``expertd generate --temp 0``
and resident mlx-lm for the same prompt and chat template, and the second server must find in
the arena everything the first one had the daemon read.
"""

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import mlx_lm
import pytest
from client_helpers import ROWS_TINY, cache_gb, parse_metrics, pool_gb
from harness import SMALL_CACHE_GB, Daemon, expertd_cli, sigint_as_usual, stop_process, wait_until
from openai import APIError, APIStatusError, NotFoundError, OpenAI

pytestmark = pytest.mark.timeout(240)

# The synthetic tokenizer has no chat template: both servers and the resident run get this one.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
PROMPT = "def main(): print("
MAX_TOKENS = 12
START_TIMEOUT = 60.0
STOP_TIMEOUT = 20.0


class Server:
    """A real ``expertd serve --port 0`` process; ``url`` is read from the line it prints."""

    def __init__(self, blob_dir, tmp_path, *flags):
        self.out = tmp_path / f"serve-{os.urandom(4).hex()}.out"
        self.err = self.out.with_suffix(".err")
        cmd = [sys.executable, "-m", "expertd", "serve", "--blobs", str(blob_dir), "--port",
               "0", "--log-level", "WARNING", *map(str, flags)]
        with open(self.out, "w") as out, open(self.err, "w") as err:
            # Sent Ctrl-C by some tests: SIGINT as a shell's foreground job has it.
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                         preexec_fn=sigint_as_usual)
        try:
            line = wait_until(self._listening, START_TIMEOUT, "expertd serve to listen")
        except BaseException:
            self.close()
            raise
        self.url = line.split(" on ", 1)[1].split()[0]
        self.base = self.url.removesuffix("/v1")
        self.client = OpenAI(base_url=self.url, api_key="expertd", max_retries=0, timeout=60)

    def _listening(self) -> str | None:
        if self.proc.poll() is not None:
            raise AssertionError(f"expertd serve exited with {self.proc.returncode}:\n"
                                 f"{self.err.read_text()}")
        return next((line for line in self.out.read_text().splitlines()
                     if line.startswith("expertd serve: ")), None)

    def get(self, path: str) -> tuple[int, str, str]:
        """Status, content type and body of GET ``path``."""
        with urllib.request.urlopen(self.base + path, timeout=30) as reply:
            return reply.status, reply.headers["Content-Type"], reply.read().decode()

    def close(self) -> int:
        """SIGTERM, then SIGKILL past ``STOP_TIMEOUT``; the exit status."""
        if stop_process(self.proc, STOP_TIMEOUT):
            raise AssertionError(f"expertd serve did not stop within {STOP_TIMEOUT:g} s of SIGTERM")
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@cache
def resident_model(model_dir):
    return mlx_lm.load(str(model_dir))


def resident_tokens(model_dir, prompt, chat_template: str | None = None) -> list[int]:
    """Greedy tokens of mlx-lm with the whole model resident (``prompt``: text or messages)."""
    model, tokenizer = resident_model(model_dir)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
        prompt = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    return [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt,
                                                     max_tokens=MAX_TOKENS)]


def reply_tokens(choice) -> list[int]:
    """Token ids of a non-streamed reply asked with ``logprobs=True`` (mlx_lm.server's form)."""
    content = choice.logprobs.model_extra.get("content") if choice.logprobs.model_extra else None
    content = content if content is not None else choice.logprobs.content
    return [item["id"] if isinstance(item, dict) else item.model_extra["id"] for item in content]


def test_two_servers_share_one_daemon(models, isolated_env, tmp_path):
    blobs, model_dir = models.blobs(), models.model()
    with (Daemon(blobs, isolated_env, "--cache-gb", SMALL_CACHE_GB) as daemon,
          Server(blobs, tmp_path, "--chat-template", CHAT_TEMPLATE) as a,
          Server(blobs, tmp_path, "--chat-template", CHAT_TEMPLATE) as b):
        assert daemon.stats()["clients"] == 2
        assert daemon.stats()["bytes_read"] == 0, "loading a server reads no expert"

        # The same greedy chat through both: the daemon reads its experts once, for the first.
        replies, grew = [], []
        for server in (a, b):
            before = daemon.stats()["bytes_read"]
            replies.append(server.client.chat.completions.create(
                model=blobs.name, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                logprobs=True))
            grew.append(daemon.stats()["bytes_read"] - before)
        assert grew[0] > 0 and grew[1] == 0, f"bytes read per server: {grew}"
        chat_tokens = [reply_tokens(r.choices[0]) for r in replies]
        assert chat_tokens[0] == chat_tokens[1] == resident_tokens(model_dir, MESSAGES,
                                                                   CHAT_TEMPLATE)
        assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
        assert replies[0].usage.completion_tokens == MAX_TOKENS

        # A plain completion equals `expertd generate --temp 0 --ignore-chat-template`.
        completion = b.client.completions.create(model=blobs.name, prompt=PROMPT,
                                                 max_tokens=MAX_TOKENS, temperature=0,
                                                 logprobs=True)
        summary = tmp_path / "generate.json"
        done = expertd_cli("generate", "--blobs", blobs, "--prompt", PROMPT, "--max-tokens",
                           MAX_TOKENS, "--temp", 0, "--ignore-chat-template",
                           "--json-summary", summary, timeout=120)
        assert done.returncode == 0, done.stderr
        generated = json.loads(summary.read_text())["tokens"]
        assert reply_tokens(completion.choices[0]) == generated == resident_tokens(model_dir,
                                                                                   PROMPT)
        assert done.stdout.startswith("=" * 10 + "\n" + completion.choices[0].text)  # mlx-lm's

        # Streaming gives the same text, chunk by chunk, and its usage when asked.
        chunks = list(a.client.chat.completions.create(
            model=blobs.name, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
            stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
            replies[0].choices[0].message.content
        assert chunks[-1].usage.completion_tokens == MAX_TOKENS
        streamed = a.client.completions.create(model=str(blobs), prompt=PROMPT,
                                               max_tokens=MAX_TOKENS, temperature=0,
                                               stream=True)
        assert "".join(c.choices[0].text for c in streamed) == completion.choices[0].text

        # Model names: the listed id, the blob path and "default_model" work; others are refused.
        assert [m.id for m in a.client.models.list()] == [blobs.name]
        assert a.client.models.retrieve(blobs.name).id == blobs.name
        with pytest.raises(NotFoundError) as refused:
            a.client.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=2)
        # OpenAI's error body, for this as for mlx_lm.server's other errors.
        assert refused.value.response.json() == {"error": {
            "message": f"model 'gpt-4o' is not served here; this server serves "
                       f"'{blobs.name}' (GET /v1/models lists it)",
            "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}
        bad = urllib.request.Request(a.url + "/completions", data=b"[1]", method="POST")
        with pytest.raises(urllib.error.HTTPError) as not_a_dict:
            urllib.request.urlopen(bad, timeout=30)
        assert json.loads(not_a_dict.value.read()) == {"error": {
            "message": "Request should be a JSON dictionary", "type": "invalid_request_error",
            "param": None, "code": "invalid_request"}}
        with pytest.raises(NotFoundError, match="not served here"):
            a.client.models.retrieve("gpt-4o")
        default = a.client.completions.create(model="default_model", prompt=PROMPT,
                                              max_tokens=MAX_TOKENS, temperature=0)
        assert default.choices[0].text == completion.choices[0].text

        assert a.get("/health")[::2] == (200, '{"status": "ok"}')
        before = daemon.stats()
        status, kind, text = a.get("/metrics")
        after = daemon.stats()
        assert status == 200 and kind.startswith("text/plain; version=0.0.4")
        values, types = parse_metrics(text)
        assert values["expertd_daemon_up"] == 1
        assert values["expertd_daemon_clients"] == 2
        # Clients report their lock-free hits with their heartbeats: hits may still grow.
        for name in ("hits", "misses", "bytes_read"):
            assert 0 < before[name] <= values[f"expertd_daemon_{name}_total"] <= after[name]
        assert types["expertd_daemon_hits_total"] == "counter"
        assert types["expertd_daemon_hit_rate"] == "gauge"
        for name in ("fill_gbps", "prefetch_hits_total"):
            assert f"expertd_daemon_{name}" in values
        # Server a: the chat, the streamed chat and completion, the refused name, the body
        # that is no JSON object (refused before the generator, counted all the same),
        # default_model.
        assert values["expertd_server_requests_total"] == 6
        assert values["expertd_server_request_errors_total"] == 2
        assert values["expertd_server_generated_tokens_total"] == 4 * MAX_TOKENS
        assert values["expertd_server_decode_tokens_per_second"] > 0
        assert values["expertd_client_fast_hits_total"] + \
            values["expertd_client_demanded_total"] > 0
        # The server's own expert memory is its pools; its steps and their host waits.
        assert values["expertd_client_pool_bytes"] in [c["pool_bytes"] for c in
                                                       after["client_pools"]]
        assert values["expertd_client_pool_bytes"] > 0
        assert values["expertd_client_steps_total"] >= 4 * MAX_TOKENS
        assert 0 < values["expertd_client_host_waits_total"]

        # Requests at the same time (mlx-lm batches them): each gets its resident answer.
        prompts = ["hello there my friend", "x = [1, 2, 3]", "import os", PROMPT]
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(lambda prompt: reply_tokens(b.client.completions.create(
                model=blobs.name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                logprobs=True).choices[0]), prompts))
        assert together == [resident_tokens(model_dir, prompt) for prompt in prompts]

        # A port already taken: one line naming it, before anything else happens.
        port = a.url.rsplit(":", 1)[1].split("/")[0]
        taken = expertd_cli("serve", "--blobs", blobs, "--port", port, timeout=120)
        assert taken.returncode == 1
        assert taken.stderr.strip().splitlines() == [
            (f"expertd serve: error: cannot listen on 127.0.0.1:{port} (Address already in "
             "use); pick another --port or stop what uses it")]

        # SIGTERM: exit 0, and the goodbye drops the client at once.
        assert a.close() == 0 and b.close() == 0
        assert daemon.stats()["clients"] == 0


def test_two_servers_batching_over_a_small_arena(models, isolated_env, tmp_path):
    """Two ``expertd serve`` processes on one daemon whose arena holds a few rows, each with
    pools of 4 rows a layer and the host copy's pulls (the device's path on this CPU), each
    sent four requests at once: both decode their requests as one batch, each step launched
    before the last is checked, the rows each one's demands evict replaying the other's
    steps; every reply is resident mlx-lm's."""
    blobs, model_dir = models.blobs(), models.model()
    prompts = ["hello there my friend", "x = [1, 2, 3]", "import os", PROMPT]
    flags = ("--pool-gb", pool_gb(blobs, 4), "--pull", "host", "--speculate", "on",
             "--decode-concurrency", len(prompts), "--prefetch", "off")
    with (Daemon(blobs, isolated_env, "--cache-gb", cache_gb(blobs, ROWS_TINY)) as daemon,
          Server(blobs, tmp_path, *flags) as a, Server(blobs, tmp_path, *flags) as b):
        def ask(job):
            server, prompt = job
            return reply_tokens(server.client.completions.create(
                model=blobs.name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                logprobs=True).choices[0])

        jobs = [(server, prompt) for server in (a, b) for prompt in prompts]
        with ThreadPoolExecutor(len(jobs)) as pool:
            replies = list(pool.map(ask, jobs))
        want = [resident_tokens(model_dir, prompt) for prompt in prompts]
        assert replies == want + want
        for server in (a, b):
            values, _ = parse_metrics(server.get("/metrics")[2])
            assert values["expertd_client_batch_steps_total"] > 0  # decoded together
            assert 0 < values["expertd_client_batch_union_ratio"] < 1
        assert daemon.stats()["fills"] > ROWS_TINY  # the two evicted each other's rows
        # A seeded request is one no batch takes (mlx_lm.server runs it alone): expertd's
        # pipelined loop, the same tokens.
        seeded = a.client.completions.create(model=blobs.name, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                             temperature=0, seed=3, logprobs=True)
        assert reply_tokens(seeded.choices[0]) == want[-1]


def test_serve_without_a_daemon(models, isolated_env):
    blobs = models.blobs()
    done = expertd_cli("serve", "--blobs", blobs, "--port", "0", timeout=120)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"start one with: expertd start --blobs {blobs}" in lines[0]
    assert done.stdout == ""


def test_serve_help_shows_defaults():
    done = expertd_cli("serve", "--help")
    assert done.returncode == 0
    for default in ("(default: 127.0.0.1)", "(default: 8080)", "(default: auto)",
                    "(default: 512)", "(default: 0.0)"):
        assert default in " ".join(done.stdout.split())  # argparse wraps lines anywhere


# The gate answers a request at once while the daemon is gone; the hang of issue 16 passed 15 s.
REFUSAL_TIMEOUT = 5.0


def assert_unavailable(server, blobs) -> None:
    """/health and a completion answer 503, with OpenAI's error body, within REFUSAL_TIMEOUT."""
    message = (f"no expertd serves {blobs.resolve()} now; start it with: expertd start --blobs "
               f"{blobs.resolve()} (this server serves again once it is back)")
    error = {"message": message, "type": "server_error", "param": None,
             "code": "daemon_unavailable"}
    with pytest.raises(urllib.error.HTTPError) as health:
        urllib.request.urlopen(server.base + "/health", timeout=REFUSAL_TIMEOUT)
    assert health.value.code == 503
    assert json.loads(health.value.read()) == {"status": "unavailable", "error": error}
    client = server.client.with_options(timeout=REFUSAL_TIMEOUT)
    with pytest.raises(APIStatusError) as refused:
        client.completions.create(model=blobs.name, prompt=PROMPT, max_tokens=MAX_TOKENS)
    assert refused.value.status_code == 503
    assert refused.value.response.json() == {"error": error}


def hang_up_mid_stream(server, blobs) -> None:
    """Ask for a long stream, read its first chunk and hang up (a reset, as a killed client)."""
    host, port = server.base.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"model": blobs.name, "prompt": PROMPT, "max_tokens": 400,
                       "temperature": 0, "stream": True}).encode()
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        received = b""
        while b"data: " not in received:
            chunk = sock.recv(4096)
            assert chunk, f"the stream ended before its first chunk: {received!r}"
            received += chunk
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def test_serve_without_its_daemon(models, isolated_env, tmp_path):
    """Killed or stopped, the daemon is missed at once: 503 with OpenAI's error body, /health
    503, a stream in flight ended by an error event; restarted, it serves again. A client
    hanging up leaves no traceback. /metrics counts it all."""
    blobs = models.blobs()
    daemon = Daemon(blobs, isolated_env, "--cache-gb", SMALL_CACHE_GB)
    try:
        with Server(blobs, tmp_path) as server:
            def complete():
                return server.client.completions.create(
                    model=blobs.name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)

            before = complete().choices[0].text
            hang_up_mid_stream(server, blobs)
            wait_until(lambda: parse_metrics(server.get("/metrics")[2])[0][
                "expertd_server_client_disconnects_total"] == 1, 60.0,
                "the hang-up counted")

            daemon.kill()
            assert_unavailable(server, blobs)
            said = server.err.read_text()  # once, on the first refusal
            assert said.count(f"expertd serve: no expertd serves {blobs.resolve()} now") == 1
            assert "; requests are answered 503" in said
            daemon.close()
            daemon = Daemon(blobs, isolated_env, "--cache-gb", SMALL_CACHE_GB)
            assert server.get("/health")[::2] == (200, '{"status": "ok"}')
            assert f"a daemon serves {blobs.resolve()} again" in server.err.read_text()
            assert complete().choices[0].text == before  # through the restarted daemon

            # Stopped (SIGTERM, as `expertd stop`) under a stream: the stream ends in an error.
            stream = server.client.with_options(timeout=REFUSAL_TIMEOUT).completions.create(
                model=blobs.name, prompt=PROMPT, max_tokens=3000, temperature=0, stream=True)
            with pytest.raises(APIError, match="no expertd serves"):
                for _ in stream:
                    if daemon.proc.poll() is None:
                        daemon.close()
            assert_unavailable(server, blobs)

            values, types = parse_metrics(server.get("/metrics")[2])
            # SIGTERM stops it while its model waits for the daemon.
            assert server.close() == 0
        assert "Traceback" not in server.err.read_text(), server.err.read_text()
    finally:
        daemon.close()
    # Four requests got a first token: two completions, the stream hung up on, the cut one.
    ttft = "expertd_server_time_to_first_token_seconds"
    assert types[ttft] == "histogram"
    assert values[f"{ttft}_count"] == values[f'{ttft}_bucket{{le="+Inf"}}'] == 4
    buckets = [v for k, v in values.items() if k.startswith(f"{ttft}_bucket")]
    assert buckets == sorted(buckets)
    assert values[f"{ttft}_sum"] > 0
    # Every completion request counts once: the four that got a first token and the two
    # refused at once (503), which count as errors too.
    assert values["expertd_server_requests_total"] == 4 + 2
    assert values["expertd_server_request_errors_total"] >= 2
    assert values["expertd_server_daemon_refusals_total"] == 3
    assert values["expertd_server_requests_running"] == 0
    assert values["expertd_server_requests_queued"] == 0
    assert types["expertd_server_requests_running"] == "gauge"
    assert values["expertd_server_prompt_tokens_per_second"] > 0
    assert values["expertd_server_decode_tokens_per_second"] > 0
    assert values["expertd_server_generated_tokens_total"] >= 2 * MAX_TOKENS + 2
    assert values["expertd_client_reconnects_total"] == 1
    assert values["expertd_daemon_up"] == 0  # scraped with the daemon stopped


def test_a_request_refused_while_it_waited_is_not_generated_later(models, isolated_env, tmp_path):
    """A request queued behind a model that waits for a stopped daemon is answered 503 once the
    daemon is killed. Its generation is stopped when the restarted daemon lets the model take
    it, not run for nobody: it is counted as abandoned before a later request is answered."""
    blobs = models.blobs()
    daemon = Daemon(blobs, isolated_env, "--cache-gb", SMALL_CACHE_GB)
    try:
        with Server(blobs, tmp_path) as server, ThreadPoolExecutor(2) as pool:
            assert daemon.stats()["bytes_read"] == 0  # the first prompt's experts need the daemon
            client = server.client.with_options(timeout=120)

            def complete(prompt):
                return client.completions.create(model=blobs.name, prompt=prompt,
                                                 max_tokens=MAX_TOKENS, temperature=0)

            def gauges():
                values = parse_metrics(server.get("/metrics")[2])[0]
                return (values["expertd_server_requests_running"],
                        values["expertd_server_requests_queued"])

            os.kill(daemon.proc.pid, signal.SIGSTOP)
            first = pool.submit(complete, PROMPT)  # taken, then waits inside the model
            wait_until(lambda: gauges() == (1, 0), 60.0, "the first request taken")
            second = pool.submit(complete, "class Point:")  # waits for the generation thread
            wait_until(lambda: gauges() == (1, 1), 60.0, "the second request queued")
            daemon.kill()
            for refused in (first, second):
                with pytest.raises(APIStatusError) as err:
                    refused.result()
                assert err.value.status_code == 503
            daemon.close()
            daemon = Daemon(blobs, isolated_env, "--cache-gb", SMALL_CACHE_GB)
            assert complete(PROMPT).choices[0].text  # taken after the second one, FIFO
            values = parse_metrics(server.get("/metrics")[2])[0]
            assert values["expertd_server_requests_abandoned_total"] == 1
            assert gauges() == (0, 0)
            assert values["expertd_server_daemon_refusals_total"] == 2
    finally:
        daemon.close()


@pytest.mark.parametrize("port", ["99999", "65536", "-1", "http"])
def test_serve_refuses_a_port_out_of_range(port):
    done = expertd_cli("serve", "--blobs", "anywhere", "--port", port)
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == (
        f"expertd serve: error: argument --port: must be a port from 0 to 65535, not '{port}'")


def test_serve_kv_cache_flags_reach_mlx_server():
    from expertd.cli.inference import serve_options
    from expertd.cli.main import build_parser
    from expertd.client.serve import mlx_server_args

    args = build_parser().parse_args(["serve", "--blobs", "b", "--kv-bits", "4",
                                      "--kv-group-size", "32", "--quantized-kv-start", "0",
                                      "--prompt-cache-bytes", "1.5GB"])
    settings = mlx_server_args(Path("b"), serve_options(args))
    assert (settings.kv_bits, settings.kv_group_size, settings.quantized_kv_start,
            settings.prompt_cache_bytes) == (4, 32, 0, 1_500_000_000)
    defaults = mlx_server_args(Path("b"), serve_options(build_parser().parse_args(
        ["serve", "--blobs", "b"])))
    assert (defaults.kv_bits, defaults.prompt_cache_bytes) == (None, None)
    for flags in (["--kv-bits", "7"], ["--prompt-cache-bytes", "lots"],
                  ["--quantized-kv-start", "-1"]):
        done = expertd_cli("serve", "--blobs", "b", *flags)
        assert done.returncode == 2 and f"argument {flags[0]}: " in done.stderr.splitlines()[-1]


def test_serve_flags_defaults_are_the_library_s():
    """serve's flags and the Python API's ``serve(options=...)`` start from the same
    mlx_lm.server settings (the client library keeps its own table: it imports nothing of the
    command line's)."""
    from expertd.choices import MLX_SERVER_DEFAULTS
    from expertd.cli.options import MLX_SERVER_FIXED, MLX_SERVER_OPTIONS

    flags = {**MLX_SERVER_FIXED, **{o.dest: o.default for o in MLX_SERVER_OPTIONS}}
    assert flags == MLX_SERVER_DEFAULTS
