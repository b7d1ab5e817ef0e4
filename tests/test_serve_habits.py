"""``expertd serve``'s habits that mlx_lm.server lacks: /health while loading, Ctrl-C in a
stream, --model, the served model's name, and refusals in OpenAI's shape (issue 26).

Real processes: a daemon, ``expertd serve``, the ``openai`` package and raw HTTP.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import nullcontext
from pathlib import Path

import pytest
from client_helpers import parse_metrics
from harness import SMALL_CACHE_GB, TINY_CACHE_GB, Daemon, stop_process, wait_until
from openai import AuthenticationError, BadRequestError, OpenAI
from test_serve import START_TIMEOUT, STOP_TIMEOUT, Server

pytestmark = pytest.mark.timeout(240)


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_health_answers_503_while_the_model_loads(models, isolated_env, tmp_path):
    """serve listens before its model is loaded: /health is 503 {"status": "loading"} (a
    completion too, in OpenAI's shape) until the model is ready, then 200. The daemon is
    stopped (SIGSTOP) while serve starts, so the load waits for its hello."""
    blobs = models.blobs()
    with Daemon(blobs, isolated_env, "--cache-gb", SMALL_CACHE_GB) as daemon:
        out = tmp_path / "serve.out"
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            with open(out, "w") as stdout:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "expertd", "serve", "--model", str(blobs), "--port",
                     "0", "--log-level", "WARNING"], stdout=stdout, stderr=subprocess.DEVNULL,
                    stdin=subprocess.DEVNULL, env={**os.environ, **isolated_env})
            try:
                line = wait_until(lambda: next((x for x in out.read_text().splitlines()
                                                if x.startswith("expertd serve (loading")),
                                               None), START_TIMEOUT, "the loading line")
                base = line.split(": ", 1)[1].split("/health")[0]
                assert get(base + "/health") == (503, {"status": "loading"})
                status, body = get(base + "/v1/models")
                assert status == 503 and body["error"]["code"] == "model_loading"
                assert "param" in body["error"]
                # HEAD: the same status without a body; OPTIONS (a browser's preflight): 204;
                # both with mlx_lm.server's CORS headers, as once loaded.
                for method, want in (("HEAD", 503), ("OPTIONS", 204)):
                    request = urllib.request.Request(base + "/health", method=method,
                                                     headers={"Origin": "http://x.test"})
                    try:
                        with urllib.request.urlopen(request, timeout=30) as reply:
                            status, headers, data = reply.status, reply.headers, reply.read()
                    except urllib.error.HTTPError as exc:
                        status, headers, data = exc.code, exc.headers, exc.read()
                    assert (status, data) == (want, b""), (method, status, data)
                    assert headers["Access-Control-Allow-Origin"] == "*", method
            finally:
                os.kill(daemon.pid, signal.SIGCONT)
            wait_until(lambda: "expertd serve: " in out.read_text(), START_TIMEOUT,
                       "the model to load")
            assert get(base + "/health") == (200, {"status": "ok"})
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
            stop_process(proc, STOP_TIMEOUT)


def test_ctrl_c_ends_a_stream_in_flight_with_an_error_and_exits_130(models, isolated_env,
                                                                     tmp_path):
    blobs = models.blobs()
    with Daemon(blobs, isolated_env, "--cache-gb", SMALL_CACHE_GB):
        server = Server(blobs, tmp_path)
        try:
            assert server.client.models.list().data  # the server answers
            from mlx_lm.utils import load_tokenizer

            tokenizer = load_tokenizer(models.model())
            body = json.dumps({"model": blobs.name, "prompt": "Once", "max_tokens": 100000,
                               "stream": True, "temperature": 0,
                               "logit_bias": {str(t): -100 for t in tokenizer.eos_token_ids}})
            request = urllib.request.Request(server.url + "/completions", data=body.encode(),
                                             headers={"Content-Type": "application/json"})
            events = []
            with urllib.request.urlopen(request, timeout=60) as stream:
                for raw in stream:
                    line = raw.decode().strip()
                    if not line.startswith("data: "):
                        continue
                    events.append(line[6:])
                    if len(events) == 3:  # tokens are flowing: interrupt the server, twice
                        server.proc.send_signal(signal.SIGINT)
                        server.proc.send_signal(signal.SIGINT)  # never cuts the shutdown short
            assert server.proc.wait(STOP_TIMEOUT) == 130
        finally:
            server.close()
    last = json.loads(events[-1])
    assert "shutting down" in last["error"]["message"] and last["error"]["type"] == "server_error"
    assert last["error"]["code"] == "server_shutting_down"
    assert all("choices" in json.loads(e) for e in events[:3])


def test_only_the_first_signal_ends_serving():
    """Ctrl-C twice: the first ends the serving loop, and one that comes after it (before the
    shutdown set SIGINT to be ignored) must not raise in the middle of that shutdown. It did
    under load in CI: the generation thread was then joined without being told to stop, and a
    stream in flight never ended."""
    from expertd.client.serve import _serve_until_signal

    class Loop:
        def serve_forever(self):
            os.kill(os.getpid(), signal.SIGINT)
            signal.sigtimedwait([], 0)  # a point where Python runs the pending handler

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a shell's foreground job
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        assert _serve_until_signal(Loop()) == signal.SIGINT
        for later in (signal.SIGINT, signal.SIGTERM):  # during the shutdown
            try:
                os.kill(os.getpid(), later)
                signal.sigtimedwait([], 0)
            except KeyboardInterrupt:
                pytest.fail(f"signal {later} interrupted the shutdown")
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


def test_names_and_refusals_in_openai_shape(models, isolated_env, tmp_path):
    """A request without "model" is answered with the served id; n=2, messages as a string and
    a prompt that is not text are refused 400 naming the parameter, never ignored."""
    blobs = models.blobs()
    with (Daemon(blobs, isolated_env, "--cache-gb", SMALL_CACHE_GB),
          Server(blobs, tmp_path) as server):
        body = json.dumps({"prompt": "Once", "max_tokens": 2}).encode()
        request = urllib.request.Request(server.url + "/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            assert json.loads(reply.read())["model"] == blobs.name
        refusals = {
            "n": dict(model=blobs.name, prompt="Once", max_tokens=2, n=2),
            "messages": dict(model=blobs.name, messages="Hi", max_tokens=2),
            "prompt": dict(model=blobs.name, prompt=[1, 2], max_tokens=2),
            # (mlx-lm's batch raised on it on the generation thread, which then died)
            "prompt ": dict(model=blobs.name, prompt="", max_tokens=2),
            "max_tokens": dict(model=blobs.name, prompt="Once", max_tokens="2"),
            "stop": dict(model=blobs.name, prompt="Once", max_tokens=2, stop=[1, "a"]),
            "stop ": dict(model=blobs.name, prompt="Once", max_tokens=2, stop=""),
            # What mlx_lm.server would take and ignore: refused, never ignored.
            "response_format": dict(messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                    response_format={"type": "json_object"}),
            "frobnicate": dict(prompt="Once", max_tokens=2, frobnicate=1),
            "messages[1].role": dict(messages=[{"role": "user", "content": "Hi"},
                                               {"role": "wizard", "content": "Hi"}],
                                     max_tokens=2),
            "echo": dict(prompt="Once", max_tokens=2, echo=True),
            "best_of": dict(prompt="Once", max_tokens=2, best_of=2),
            "suffix": dict(prompt="Once", max_tokens=2, suffix="end"),
            # An image part: mlx_lm.server fetched its URL (any a caller named) for a model
            # that reads text only.
            "messages[0].content[1].type": dict(messages=[{"role": "user", "content": [
                {"type": "text", "text": "Hi"},
                {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x"}}]}],
                max_tokens=2),
            "tools ": dict(messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                           tools="x"),
            # A provider's refusal (adapters not loaded here) is the caller's error: 400.
            "adapters": dict(prompt="Once", max_tokens=2, adapters="/nowhere"),
            # The synthetic model has no chat template: its tools would vanish unsaid.
            "tools": dict(messages=[{"role": "user", "content": "Hi"}], max_tokens=2, tools=[
                {"type": "function", "function": {"name": "f", "parameters": {}}}]),
        }
        before = parse_metrics(server.get("/metrics")[2])[0]
        for param, fields in refusals.items():
            param = param.strip()  # a second case of one parameter
            path = "/chat/completions" if "messages" in fields else "/completions"
            request = urllib.request.Request(server.url + path, data=json.dumps(fields).encode(),
                                             headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=60)
            assert refused.value.code == 400
            error = json.loads(refused.value.read())["error"]
            assert error["param"] == param and error["type"] == "invalid_request_error", error
        with pytest.raises(BadRequestError, match="n must be 1"):
            server.client.completions.create(model=blobs.name, prompt="Once", max_tokens=2, n=2)
        # Refused before any generation, by mlx-lm's checks: a body that is no JSON, no tokens.
        for data in (b"{not json", json.dumps(dict(prompt="Once", max_tokens=0)).encode()):
            request = urllib.request.Request(server.url + "/completions", data=data,
                                             headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=60)
            assert refused.value.code == 400
        # Every refusal is a request and an error in /metrics.
        after = parse_metrics(server.get("/metrics")[2])[0]
        for name in ("expertd_server_requests_total", "expertd_server_request_errors_total"):
            assert after[name] - before[name] == len(refusals) + 3, (name, before, after)
        # A POST to no completion endpoint is no completion request: not counted.
        for path in ("/v1/embeddings", "/metrics"):
            assert _ask(server.base + path, None, b"{}")[0] == 404
        again = parse_metrics(server.get("/metrics")[2])[0]
        for name in ("expertd_server_requests_total", "expertd_server_request_errors_total"):
            assert again[name] == after[name], (name, after, again)
        # Routes: a query changes none; a path of no endpoint is a 404 of ours (mlx_lm.server's
        # GET listed a Hugging Face cache, or failed); HEAD /health is a probe's status.
        assert get(server.base + "/v1/models?limit=2") == get(server.base + "/v1/models")
        # The model's "created" is one time, not each listing's: the same a second later.
        listed = get(server.base + "/v1/models")[1]["data"][0]["created"]
        wait_until(lambda: int(time.time()) > listed, 5, "the clock to pass a second")
        assert get(server.base + "/v1/models")[1]["data"][0]["created"] == listed
        assert get(server.base + "/health?x=1") == (200, {"status": "ok"})
        status, body = get(server.base + "/v1/modelsX")
        assert status == 404 and body["error"]["code"] == "not_found"
        head = urllib.request.Request(server.base + "/health", method="HEAD")
        with urllib.request.urlopen(head, timeout=30) as reply:
            assert (reply.status, reply.read()) == (200, b"")
        # What asks for nothing is taken: bookkeeping fields, inert values.
        reply = server.client.chat.completions.create(
            model=blobs.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
            user="someone", metadata={"k": "v"}, response_format={"type": "text"})
        assert reply.choices


def test_stop_names_the_clients_left_waiting(models, isolated_env, tmp_path):
    """``expertd stop`` names the attached clients and what they do now; status says the same
    kind for each."""
    from harness import expertd_cli

    blobs = models.blobs()
    with Daemon(blobs, isolated_env, "--cache-gb", SMALL_CACHE_GB), \
            Server(blobs, tmp_path) as server:
        status = expertd_cli("status", "--blobs", blobs, timeout=60)
        assert f"serve pid {server.proc.pid}" in status.stdout, status.stdout
        # JSON: the same kind, and every key whether or not a heartbeat has reported yet.
        entry, = json.loads(expertd_cli("status", "--blobs", blobs, "--json",
                                        timeout=60).stdout)[0]["client_pools"]
        assert entry["kind"] == "serve" and entry["pid"] == server.proc.pid
        assert {"pool_bytes", "steps", "host_waits", "replays", "pulled_rows",
                "pulled_bytes"} <= entry.keys(), entry
        done = expertd_cli("stop", "--blobs", blobs, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"1 client attached (serve pid {server.proc.pid}); it waits for a daemon" in done.stdout


def test_a_host_that_is_not_ours_gets_host_advice(models, isolated_env):
    """An address of another machine is not a busy port: serve says which it is."""
    from harness import expertd_cli

    blobs = models.blobs()
    with Daemon(blobs, isolated_env, "--cache-gb", SMALL_CACHE_GB):
        done = expertd_cli("serve", "--blobs", blobs, "--host", "192.0.2.7", "--port", "0",
                           timeout=120)
        # A name that does not resolve is not a busy port either (issue 26 item 14): the flag's
        # fault, or (no resolver for now) the machine's, never a port to pick.
        nameless = expertd_cli("serve", "--blobs", blobs, "--host", "no-such-host.invalid",
                               "--port", "0", timeout=120)
    assert done.returncode == 1, done
    line, = done.stderr.strip().splitlines()
    assert "192.0.2.7 is not an address of this machine" in line and "--port" not in line
    line, = nameless.stderr.strip().splitlines()
    if "cannot resolve no-such-host.invalid now" in line:
        assert nameless.returncode == 1, nameless
    else:
        assert nameless.returncode == 2, nameless
        assert line.startswith("expertd serve: error: --host no-such-host.invalid: not an address "
                               "or a name this machine resolves"), line
    assert "--port" not in line


def test_a_stop_word_inside_a_token_ends_the_request(models, isolated_env, tmp_path):
    """OpenAI's stop: the first occurrence of a stop word in the text ends generation with
    finish_reason "stop", whether or not the tokens spell it on their own (mlx_lm.server 0.32
    stripped such a word from the text and kept generating), and no part of the word is sent,
    streamed or not."""
    blobs = models.blobs()
    with (Daemon(blobs, isolated_env, "--cache-gb", SMALL_CACHE_GB),
          Server(blobs, tmp_path) as server):
        ask = dict(model=blobs.name, prompt="Once", max_tokens=40, temperature=0)
        free = server.client.completions.create(**ask)
        text = free.choices[0].text
        # A two-character word from inside the text, not at its start.
        word = next(text[i:i + 2] for i in range(2, len(text) - 2)
                    if text[i:i + 2].isalpha() and text[i:i + 2] not in text[:i + 1])
        stopped = server.client.completions.create(**ask, stop=[word])
        chunks = list(server.client.completions.create(**ask, stop=[word], stream=True))
        # A word across two tokens: the first token's last character is held back until the
        # second shows the word (mlx_lm.server's text state machine holds what may begin a
        # stop word), streamed or not.
        pieces = [c.choices[0].text for c in server.client.completions.create(**ask, stream=True)
                  if c.choices and c.choices[0].text]
        at = [len("".join(pieces[:j + 1])) for j in range(len(pieces))]
        across = next(text[b - 1:b + 1] for b in at[:-1]
                      if text.find(text[b - 1:b + 1]) == b - 1 and text[b - 1:b + 1].strip())
        split = {stream: server.client.completions.create(**ask, stop=[across], stream=stream)
                 for stream in (False, True)}
        # A word inside the last token allowed still ends with "stop", not "length".
        first = server.client.completions.create(**{**ask, "max_tokens": 1})
        last = (server.client.completions.create(**{**ask, "max_tokens": 1},
                                                 stop=[first.choices[0].text[-1:]])
                if first.choices[0].text.strip() else None)
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop" and word not in choice.text
    # The text up to the word, and none of the word.
    assert choice.text == text[:text.index(word)]
    assert stopped.usage.completion_tokens < free.usage.completion_tokens
    assert "".join(pieces) == text
    assert split[False].choices[0].text == text[:text.index(across)]
    assert "".join(c.choices[0].text for c in split[True] if c.choices) == \
        text[:text.index(across)]
    # Streamed, the same text in pieces, and the last piece says why it stopped.
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "stop" and set(reasons[:-1]) <= {None}
    # The stopping token's own text before the word is kept (it was dropped whole before).
    assert last is None or (last.choices[0].finish_reason == "stop" and
                            last.choices[0].text == first.choices[0].text[:-1])


def test_sigterm_while_loading_stops_serve_cleanly(models, isolated_env, tmp_path):
    blobs = models.blobs()
    with Daemon(blobs, isolated_env, "--cache-gb", SMALL_CACHE_GB) as daemon:
        out = tmp_path / "serve.out"
        os.kill(daemon.pid, signal.SIGSTOP)  # the load waits for the daemon's hello
        try:
            with open(out, "w") as stdout:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "expertd", "serve", "--blobs", str(blobs), "--port",
                     "0"], stdout=stdout, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                    env={**os.environ, **isolated_env})
            try:
                wait_until(lambda: "expertd serve (loading" in out.read_text(), START_TIMEOUT,
                           "the loading line")
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(STOP_TIMEOUT) == 0
            finally:
                stop_process(proc, STOP_TIMEOUT)
        finally:
            os.kill(daemon.pid, signal.SIGCONT)


def test_status_json_names_a_daemon_that_does_not_answer(models, isolated_env):
    """A daemon stopped with SIGSTOP holds its lock but answers nothing: status --json lists
    it as not answering (exit 1 with --blobs), never leaves it out."""
    from harness import expertd_cli

    blobs = models.blobs()
    with Daemon(blobs, isolated_env, "--cache-gb", SMALL_CACHE_GB) as daemon:
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            one = expertd_cli("status", "--blobs", blobs, "--json", "--timeout", "1", timeout=60)
            every = expertd_cli("status", "--json", "--timeout", "1", timeout=60)
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
    assert one.returncode == 1, one
    entry, = json.loads(one.stdout)
    assert entry["answering"] is False and entry["blob_dir"] == str(blobs.resolve())
    assert any(d.get("answering") is False for d in json.loads(every.stdout)), every.stdout


def _ask(url: str, key: str | None = None, data: bytes | None = None) -> tuple[int, dict, bytes]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, reply.headers, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


def test_an_api_key_guards_every_request_but_health(models, isolated_env, tmp_path):
    """Without its key a server answered any user of the machine (the model, /metrics' daemon
    stats, and the prompt cache's cached_tokens, an oracle for others' prompts). With
    --api-key-file, every request but /health must bear the key: 401 in OpenAI's shape
    otherwise, wrong key or none."""
    blobs = models.blobs()
    key = "k3y-" + os.urandom(8).hex()
    key_file = tmp_path / "key"
    key_file.write_text(key + "\n")
    os.chmod(key_file, 0o600)
    with (Daemon(blobs, isolated_env, "--cache-gb", SMALL_CACHE_GB),
          Server(blobs, tmp_path, "--api-key-file", key_file) as server):
        assert "requests need its API key" in server.out.read_text()
        assert _ask(server.base + "/health")[0] == 200
        completion = json.dumps({"prompt": "Once", "max_tokens": 2}).encode()
        for path, data in (("/v1/models", None), ("/metrics", None),
                           ("/v1/completions", completion)):
            for given in (None, "not-" + key, key[:-1]):
                status, headers, body = _ask(server.base + path, given, data)
                assert status == 401, (path, given, status)
                error = json.loads(body)["error"]
                assert error["code"] == "invalid_api_key" and "param" in error, error
                assert headers["WWW-Authenticate"] == "Bearer"
                assert headers["Access-Control-Allow-Origin"] == "*"  # a browser reads it
            status, _, body = _ask(server.base + path, key, data)
            assert status == 200, (path, body)
        basic = urllib.request.Request(server.base + "/v1/models",
                                       headers={"Authorization": f"Basic {key}"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(basic, timeout=30)
        assert "send the header Authorization: Bearer KEY" in refused.value.read().decode()
        with pytest.raises(AuthenticationError):
            server.client.models.list()  # the fixture's client has another key
        client = OpenAI(base_url=server.url, api_key=key, max_retries=0, timeout=60)
        reply = client.completions.create(model=blobs.name, prompt="Once", max_tokens=2)
        assert reply.choices[0].text is not None and reply.model == blobs.name


def test_an_api_key_file_must_be_private_and_hold_one_key(tmp_path):
    from expertd.client.serve_auth import read_api_key

    key_file = tmp_path / "key"
    key_file.write_text("abc\n")
    os.chmod(key_file, 0o640)
    with pytest.raises(ValueError, match="other users may read it .*chmod 600"):
        read_api_key(str(key_file))
    os.chmod(key_file, 0o600)
    assert read_api_key(str(key_file)) == "abc"
    fifo = tmp_path / "fifo"  # nobody writes it: read as a file, it would block for ever
    os.mkfifo(fifo, 0o600)
    for where in (fifo, tmp_path):
        with pytest.raises(ValueError, match="not a regular file"):
            read_api_key(str(where))
    for text, words in (("", 0), ("a b\n", 2)):
        key_file.write_text(text)
        with pytest.raises(ValueError, match=f"holds {words} words"):
            read_api_key(str(key_file))
    with pytest.raises(ValueError, match="No such file"):
        read_api_key(str(tmp_path / "missing"))
    for text in ("k\u00e9y", "k" * 5000):  # a header is read as latin-1; a file has a bound
        key_file.write_text(text)
        with pytest.raises(ValueError, match="one word of ASCII of at most 4096 bytes"):
            read_api_key(str(key_file))
    assert read_api_key(None, {"EXPERTD_API_KEY": "xyz"}) == "xyz"
    for value in ("a b", ""):  # "": a failed $(cat FILE) would leave the server open
        with pytest.raises(ValueError, match="one word of ASCII"):
            read_api_key(None, {"EXPERTD_API_KEY": value})
    assert read_api_key(None, {}) is None
    refused = subprocess.run([sys.executable, "-m", "expertd", "serve", "--blobs",
                              str(tmp_path), "--api-key-file", str(tmp_path / "missing")],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "--api-key-file" in refused.stderr
    assert "Traceback" not in refused.stderr and refused.stderr.count("\n") == 1, refused.stderr


def test_health_polled_from_the_first_moment_never_breaks_the_load(models, isolated_env,
                                                                   tmp_path):
    """The README's snippet polls /health while serve loads. The loading handler imported
    mlx_lm.server on the HTTP thread while the main thread imported mlx-lm to load the model,
    and serve died ("cannot import name ... from partially initialized module"). Polled as
    fast as it answers from the moment it listens: 503 loading, then 200, and serve lives."""
    blobs = models.blobs()
    with Daemon(blobs, isolated_env, "--cache-gb", SMALL_CACHE_GB):
        out = tmp_path / "serve.out"
        with open(out, "w") as stdout, open(tmp_path / "serve.err", "w") as stderr:
            proc = subprocess.Popen(
                [sys.executable, "-m", "expertd", "serve", "--blobs", str(blobs), "--port", "0",
                 "--log-level", "WARNING"], stdout=stdout, stderr=stderr,
                stdin=subprocess.DEVNULL, env={**os.environ, **isolated_env})
        try:
            line = wait_until(lambda: next((x for x in out.read_text().splitlines()
                                            if x.startswith("expertd serve (loading")), None),
                              START_TIMEOUT, "the loading line", interval=0.002)
            base = line.split(": ", 1)[1].split("/health")[0]
            seen = []

            def ready() -> bool:
                assert proc.poll() is None, (tmp_path / "serve.err").read_text()
                seen.append(get(base + "/health"))
                return seen[-1] == (200, {"status": "ok"})

            wait_until(ready, START_TIMEOUT, "serve to be ready", interval=0.002)
            assert set(map(str, seen[:-1])) <= {str((503, {"status": "loading"}))}, seen
        finally:
            stop_process(proc, STOP_TIMEOUT)


def test_serve_on_a_checkpoint_says_convert_it_first(models, isolated_env):
    """An mlx-lm checkpoint given for --blobs: serve said start a daemon for it, which start
    then refused (run expertd convert first): the user was sent round in a circle."""
    checkpoint = models.blobs() / "trunk"  # config.json and safetensors: a checkpoint's look
    done = subprocess.run([sys.executable, "-m", "expertd", "serve", "--blobs", str(checkpoint),
                           "--port", "0"], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 1 and "run expertd convert first" in done.stderr, done.stderr
    assert "expertd start" not in done.stderr and "Traceback" not in done.stderr


def test_a_daemon_paused_past_its_heartbeats_leaves_serve_serving(models, isolated_env,
                                                                  tmp_path):
    """A daemon stopped (SIGSTOP) for longer than the client's time-to-dead while a request
    waited on it: the client raised an error inside the model, which killed mlx_lm.server's
    generation thread for good (every later request: "generation thread died"). Now the
    session waits for it as for a daemon gone, says so, and the request completes once the
    daemon is resumed; so does the next."""
    blobs = models.blobs()
    body = json.dumps({"prompt": "Zebra quantum xylophone banana", "max_tokens": 4}).encode()
    with (Daemon(blobs, isolated_env, "--cache-gb", TINY_CACHE_GB, "--client-timeout", "2",
                 "--heartbeat", "0.2") as daemon,
          Server(blobs, tmp_path) as server):
        url = server.url + "/completions"
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            done = {}
            waiter = threading.Thread(target=lambda: done.setdefault("first", _ask(url, None,
                                                                                   body)))
            waiter.start()
            wait_until(lambda: "answered no heartbeat" in server.err.read_text(), 60,
                       "serve's session to say it waits for the daemon")
            # Meanwhile /health says so (it said ok while requests hung on the daemon).
            status, health = get(server.base + "/health")
            assert status == 503 and "does not answer" in health["error"]["message"], health
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        waiter.join(120)
        # Once (CI, under the whole suite) the first request was answered 503 "no expertd
        # serves": the logs of both sides say which look found no daemon, should it recur.
        logs = f"\ndaemon:\n{daemon.log_text()[-3000:]}\nserve:\n{server.err.read_text()[-3000:]}"
        assert done["first"][0] == 200, f"{done['first'][0]} {done['first'][2][:300]!r}{logs}"
        status, _, reply = _ask(url, None, body)
        assert status == 200 and json.loads(reply)["choices"], f"{reply[:300]!r}{logs}"


def _readme_health_loop() -> str:
    """The README's loop that waits for serve, as a user copies it."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start = text.index("for i in $(seq 60); do")
    return text[start:text.index("\ndone", start) + len("\ndone")]


@pytest.mark.skipif(not shutil.which("curl"), reason="the README's snippet uses curl")
@pytest.mark.parametrize("daemon", [False, True], ids=["serve-fails", "serve-ready"])
def test_the_readmes_health_loop_ends_when_serve_fails_and_when_it_is_ready(
        models, isolated_env, tmp_path, daemon):
    """Issue 26 item 9: the README's snippet looped forever when serve failed. Run as written
    (only the port changed), against a real serve: without a daemon serve fails and the loop
    ends on its pid; with one, it ends on /health's "ok"."""
    import socket

    blobs = models.blobs()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = (f"{sys.executable} -m expertd serve --blobs {blobs} --port {port} & serve=$!\n"
              + _readme_health_loop().replace("localhost:8080", f"localhost:{port}")
              + '\necho "ended at $i"\n'
              f"curl -sf localhost:{port}/health && echo ' ready'\n"
              "kill $serve 2> /dev/null; wait $serve\n")
    with Daemon(blobs, isolated_env, "--cache-gb", SMALL_CACHE_GB) if daemon else nullcontext():
        done = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                              timeout=120, env={**os.environ, **isolated_env})
    ended = int(done.stdout.split("ended at ")[1].split()[0])
    assert ended < 60, done.stdout  # left by a break, not by running out of tries
    if daemon:
        assert done.stdout.rstrip().endswith('"ok"} ready'), done.stdout
    else:
        assert " ready" not in done.stdout
        assert "expertd serve: error: " in done.stderr and "expertd start --blobs" in \
            done.stderr, done.stderr


def _requests_gauges(server) -> tuple:
    """(running, queued) of /metrics."""
    values = parse_metrics(server.get("/metrics")[2])[0]
    return (values["expertd_server_requests_running"],
            values["expertd_server_requests_queued"])


def test_a_request_still_queued_at_sigterm_is_answered_503_shutting_down(models, isolated_env,
                                                                         tmp_path):
    """SIGTERM while one request computes (its daemon stopped, so it cannot finish) and another
    waits for the generation thread to take it: both are answered 503 server_shutting_down.
    The queued one was answered 404 not_found (mlx-lm's answer to whatever its generate
    raised)."""
    blobs = models.blobs()
    with (Daemon(blobs, isolated_env, "--cache-gb", TINY_CACHE_GB) as daemon,
          Server(blobs, tmp_path) as server):
        url = server.url + "/completions"
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            answers, waiters = {}, []
            for name, prompt in (("running", "Zebra quantum xylophone banana"),
                                 ("queued", "Other words here")):
                body = json.dumps({"prompt": prompt, "max_tokens": 4}).encode()
                waiters.append(threading.Thread(
                    target=lambda n=name, b=body: answers.setdefault(n, _ask(url, None, b))))
                waiters[-1].start()
                wanted = (1, 0) if name == "running" else (1, 1)
                wait_until(lambda w=wanted: _requests_gauges(server) == w, 120,
                           f"a request {name}")
            server.proc.send_signal(signal.SIGTERM)
            for waiter in waiters:
                waiter.join(120)
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        assert server.proc.wait(STOP_TIMEOUT) == 0
    for name in ("running", "queued"):
        status, _, body = answers[name]
        error = json.loads(body)["error"]
        assert status == 503 and error["code"] == "server_shutting_down", (name, status, body)
        assert error["type"] == "server_error"


def test_use_default_chat_template_without_one_is_refused_in_one_line(models, isolated_env):
    """--use-default-chat-template on a tokenizer that has no default template (the tokenizers
    library no longer gives one): one line naming --chat-template, exit 2, not an
    AttributeError's traceback once the model had loaded."""
    from harness import expertd_cli

    blobs = models.blobs()
    with Daemon(blobs, isolated_env, "--cache-gb", SMALL_CACHE_GB):
        done = expertd_cli("serve", "--blobs", blobs, "--port", "0", "--log-level", "WARNING",
                           "--use-default-chat-template", timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "--chat-template TEMPLATE" in done.stderr, \
        done.stderr
