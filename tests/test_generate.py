"""`expertd generate`: mlx_lm.generate's flags, and a summary of this client's own use of the cache."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from harness import Daemon

from expertd.manifest import Manifest

PROMPT = "Once upon a time"


def run_generate(blob_dir, env, out, *flags, stdin=None):
    """One ``expertd generate`` process; its JSON summary and its summary line (on stderr)."""
    proc = subprocess.run([sys.executable, "-m", "expertd", "generate", "--blobs", str(blob_dir),
                           "--max-tokens", "8", "--json-summary", str(out), *flags],
                          env={**os.environ, **env}, input=stdin or "", capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("[expertd] prompt")]
    assert len(lines) == 1, proc.stderr
    return json.loads(out.read_text()), lines[0]


def test_the_summary_is_this_clients_own(models, isolated_env, tmp_path):
    blob_dir = models.blobs()
    stride = Manifest.load(blob_dir).stride
    with Daemon(blob_dir, isolated_env, "--cache-gb", "0.01"):
        cold, _ = run_generate(blob_dir, isolated_env, tmp_path / "a.json", "--prompt", PROMPT,
                               "--prefetch", "off")
        warm, line = run_generate(blob_dir, isolated_env, tmp_path / "b.json", "--prompt",
                                  PROMPT, "--prefetch", "off")
    assert cold["misses"] > 0 and cold["bytes_read"] == cold["misses"] * stride
    assert cold["bytes_read"] == cold["daemon_bytes_read"]  # it was alone
    # Every routed expert was in the pool or moved into it; every move was found in the arena
    # or demanded (prefetch off: nothing was written ahead).
    assert cold["hits"] + cold["misses"] == cold["pool_hits"] + cold["pool_moved"]
    assert cold["pool_moved"] == cold["fast_hits"] + cold["demanded"]
    # The same prompt again: everything was read for the first client already.
    assert warm["tokens"] == cold["tokens"]
    assert warm["misses"] == warm["bytes_read"] == warm["daemon_bytes_read"] == 0
    assert warm["hit_rate"] == 1.0 and warm["hits"] > 0
    assert "hit rate 100.0% | read 0.0 MiB" in line
    # A forward per token at least (mlx-lm runs one step ahead and the prompt on its own): a
    # speculative one waits for the host once, another (or a replay) once per MoE layer.
    assert warm["steps"] >= len(warm["tokens"])
    layers = len(Manifest.load(blob_dir).layers)
    per_layer = (warm["steps"] - warm["speculative_steps"] - warm["unchecked_steps"]
                 + warm["replays"])
    assert warm["host_waits"] == warm["speculative_steps"] + per_layer * layers
    assert " host waits a step" in line


def test_prefetches_asked_for_count_as_this_clients_reads(models, isolated_env, tmp_path):
    blob_dir = models.blobs()
    stride = Manifest.load(blob_dir).stride
    with Daemon(blob_dir, isolated_env, "--cache-gb", "0.01"):
        summary, _ = run_generate(blob_dir, isolated_env, tmp_path / "a.json", "--prompt",
                                  PROMPT, "--prefetch", "on")
    assert summary["prefetch_reads"] > 0
    assert summary["bytes_read"] == (summary["misses"] + summary["prefetch_reads"]) * stride
    assert summary["bytes_read"] == summary["daemon_bytes_read"]


def test_prompt_dash_reads_stdin(models, isolated_env, tmp_path):
    blob_dir = models.blobs()
    with Daemon(blob_dir, isolated_env, "--cache-gb", "0.01"):
        given, _ = run_generate(blob_dir, isolated_env, tmp_path / "a.json", "--prompt", PROMPT)
        piped, _ = run_generate(blob_dir, isolated_env, tmp_path / "b.json", "--prompt", "-",
                                stdin=PROMPT)
    assert piped["prompt_tokens"] == given["prompt_tokens"] > 1
    assert piped["tokens"] == given["tokens"]


def test_sampling_flags_are_mlx_lms(models, isolated_env, tmp_path):
    blob_dir = models.blobs()
    flags = ("--prompt", PROMPT, "--temp", "1.0", "--top-p", "0.9", "--min-p", "0.01",
             "--top-k", "5", "--seed")
    with Daemon(blob_dir, isolated_env, "--cache-gb", "0.01"):
        one, _ = run_generate(blob_dir, isolated_env, tmp_path / "a.json", *flags, "7")
        two, _ = run_generate(blob_dir, isolated_env, tmp_path / "b.json", *flags, "7")
        top1, _ = run_generate(blob_dir, isolated_env, tmp_path / "c.json", "--prompt", PROMPT,
                               "--temp", "1.0", "--top-k", "1", "--seed", "7")
        greedy, _ = run_generate(blob_dir, isolated_env, tmp_path / "d.json", "--prompt", PROMPT)
    assert one["tokens"] == two["tokens"] and len(one["tokens"]) == 8  # the seed repeats it
    # top-k 1 leaves the sampler one choice: greedy decoding, whatever the temperature.
    assert top1["tokens"] == greedy["tokens"]


def test_tilde_in_blobs_is_expanded_by_start_generate_and_status(models, isolated_env, tmp_path,
                                                                  monkeypatch):
    """`--blobs ~/...` given literally (no shell to expand it), as a launchd agent or a quoted
    argument would pass it."""
    home = tmp_path / "home"
    (home / "blobs").mkdir(parents=True)
    os.symlink(models.blobs(), home / "blobs" / "tiny")
    monkeypatch.setenv("HOME", str(home))  # for the harness's own client too
    env = {**isolated_env, "HOME": str(home)}
    with Daemon("~/blobs/tiny", env, "--cache-gb", "0.01") as daemon:
        assert daemon.ready["blob_dir"] == str(models.blobs().resolve())
        summary, _ = run_generate("~/blobs/tiny", env, tmp_path / "a.json", "--prompt", PROMPT)
        status = subprocess.run([sys.executable, "-m", "expertd", "status", "--blobs",
                                 "~/blobs/tiny", "--json"], env={**os.environ, **env},
                                capture_output=True, text=True, timeout=60)
    assert len(summary["tokens"]) == 8
    assert status.returncode == 0 and json.loads(status.stdout)[0]["pid"] == daemon.pid



# ---- mlx_lm.generate's habits: stdout is the text, its flags reach stream_generate ------------

def resident_runs(model_dir, max_tokens: int, **runs) -> dict:
    """mlx-lm's own (tokens, text) for PROMPT under each run's options, the whole model loaded
    in this process."""
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(model_dir))
    out = {}
    for name, options in runs.items():
        replies = list(mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=max_tokens,
                                              **options))
        out[name] = [r.token for r in replies], "".join(r.text for r in replies)
    return out


def test_stdout_is_the_text_and_mlx_lm_flags_reach_stream_generate(models, isolated_env,
                                                                   tmp_path):
    """mlx-lm's summary block follows the text on stdout, expertd's line goes to stderr,
    --verbose False drops both,
    and --max-kv-size, --kv-*, --prefill-step-size and --extra-eos-token act as in mlx-lm."""
    blob_dir, n = models.blobs(), 24
    quantize = dict(kv_bits=4, kv_group_size=32, quantized_kv_start=0)
    want = resident_runs(models.model(), n, plain={}, rotating=dict(max_kv_size=6),
                         quantized=quantize)
    plain, rotating, quantized = (want[k][0] for k in ("plain", "rotating", "quantized"))
    assert plain != rotating and plain != quantized  # an option left behind would show
    stop = next(i for i, t in enumerate(quantized) if i > 1 and t not in quantized[:i])
    runs = {"plain": ("--verbose", "True"),
            "rotating": ("--max-kv-size", "6", "--prefill-step-size", "1", "--verbose", "F"),
            "quantized": ("--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "0",
                          "--extra-eos-token", str(quantized[stop]))}
    done, got = {}, {}
    with Daemon(blob_dir, isolated_env, "--cache-gb", "0.01"):
        for name, flags in runs.items():
            summary = tmp_path / f"{name}.json"
            done[name] = subprocess.run(
                [sys.executable, "-m", "expertd", "generate", "--model", str(blob_dir), "-p",
                 PROMPT, "-m", str(n), "--json-summary", str(summary), *flags],
                env={**os.environ, **isolated_env}, stdin=subprocess.DEVNULL,
                capture_output=True, text=True, timeout=120)
            assert done[name].returncode == 0, done[name].stderr
            got[name] = json.loads(summary.read_text())
    # stdout is the text, then mlx_lm.generate's block (scripts parse it); --verbose False
    # leaves the text alone, as mlx_lm.generate does. expertd's own line goes to stderr.
    p = got["plain"]
    assert done["plain"].stdout == (
        f"==========\n{want['plain'][1]}\n==========\n"
        f"Prompt: {p['prompt_tokens']} tokens, {p['prompt_tps']:.3f} tokens-per-sec\n"
        f"Generation: {p['generation_tokens']} tokens, {p['generation_tps']:.3f} tokens-per-sec\n"
        f"Peak memory: {p['peak_memory_gb']:.3f} GB\n")
    assert done["rotating"].stdout == want["rotating"][1] + "\n"
    lines = done["plain"].stderr.splitlines()
    assert lines[-1].startswith("[expertd] prompt ") and " | hit rate " in lines[-1]
    assert got["plain"]["peak_memory_gb"] > 0
    assert done["rotating"].stderr == ""  # --verbose F
    assert got["plain"]["tokens"] == plain and got["rotating"]["tokens"] == rotating
    # One prefill step per prompt token but the last, instead of one for the whole prompt.
    assert got["rotating"]["steps"] - got["plain"]["steps"] == got["plain"]["prompt_tokens"] - 2
    assert got["plain"]["prompt_tokens"] > 2
    # mlx-lm ends on the extra EOS token, and yields it last, as on its own.
    assert got["quantized"]["tokens"] == quantized[:stop + 1]


TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}"
            "{% if terse %}be terse{% endif %}")


def test_mlx_lm_prompt_and_sampling_flags(models, isolated_env, tmp_path):
    """generate's default prompt is mlx_lm.generate's; \\n typed in a prompt is a newline;
    --chat-template-config reaches the template, --prefill-response starts the reply, and
    XTC sampling draws what mlx-lm's sampler draws (and not what it draws without XTC)."""
    import shutil

    import mlx.core as mx
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    from expertd.tools.convert import convert

    model_dir, blob_dir = tmp_path / "model", tmp_path / "blobs"
    shutil.copytree(models.model(), model_dir)  # the tiny model, with a chat template
    config = model_dir / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": TEMPLATE}))
    convert(model_dir, blob_dir, progress=False)
    model, tokenizer = mlx_lm.load(str(model_dir))

    def prompt_tokens(messages, **kwargs):
        tokenizer.chat_template = TEMPLATE
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        return len(tokenizer.encode(text, add_special_tokens=False))

    user = [{"role": "user", "content": "hello"}]
    runs = {
        "default": (),
        "newline": ("--prompt", "a\\nb", "--ignore-chat-template"),
        "config": ("--chat-template-config", '{"terse": true}'),
        "prefill": ("--prefill-response", "Sure"),
        "xtc": ("--prompt", PROMPT, "--ignore-chat-template", "--temp", "1", "--seed", "3",
                "--xtc-probability", "1", "--xtc-threshold", "0.05"),
    }
    got = {}
    with Daemon(blob_dir, isolated_env, "--cache-gb", "0.01"):
        for name, flags in runs.items():
            got[name], _ = run_generate(blob_dir, isolated_env, tmp_path / f"{name}.json", *flags)
    assert got["default"]["prompt_tokens"] == prompt_tokens(user, add_generation_prompt=True)
    assert got["newline"]["prompt_tokens"] == len(tokenizer.encode("a\nb"))
    assert got["config"]["prompt_tokens"] == prompt_tokens(user, add_generation_prompt=True,
                                                           terse=True)
    assert got["prefill"]["prompt_tokens"] == prompt_tokens(
        user + [{"role": "assistant", "content": "Sure"}], continue_final_message=True)
    assert len({got[k]["prompt_tokens"] for k in ("default", "config", "prefill")}) == 3

    def sampled(**xtc):  # as mlx_lm.generate --seed 3: seeded, then the model loaded
        mx.random.seed(3)
        model, tokenizer = mlx_lm.load(str(model_dir))
        special = tokenizer.encode("\n") + list(tokenizer.eos_token_ids)
        sampler = make_sampler(1.0, xtc_special_tokens=special, **xtc)
        return [r.token for r in mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=8,
                                                         sampler=sampler)]

    want = sampled(xtc_probability=1.0, xtc_threshold=0.05)
    assert got["xtc"]["tokens"] == want and want != sampled()


def test_prefill_response_without_a_chat_template_is_refused(models, isolated_env, tmp_path):
    blob_dir = models.blobs()
    with Daemon(blob_dir, isolated_env, "--cache-gb", "0.01"):
        proc = subprocess.run([sys.executable, "-m", "expertd", "generate", "--blobs",
                               str(blob_dir), "--prefill-response", "Sure"],
                              env={**os.environ, **isolated_env}, capture_output=True, text=True,
                              timeout=120)
    assert proc.returncode != 0 and "--prefill-response needs the chat template" in proc.stderr
    assert "Traceback" not in proc.stderr
    for config, said in (('{"tokenize": true}', "tokenize is set by generate itself"),
                         ('{"x": 1}', "--chat-template-config needs the chat template")):
        with Daemon(blob_dir, isolated_env, "--cache-gb", "0.01"):
            bad = subprocess.run([sys.executable, "-m", "expertd", "generate", "--blobs",
                                  str(blob_dir), "--chat-template-config", config],
                                 env={**os.environ, **isolated_env}, capture_output=True,
                                 text=True, timeout=120)
        assert bad.returncode == 2 and said in bad.stderr, bad.stderr
        assert "Traceback" not in bad.stderr


def test_no_seed_samples_anew_and_a_seed_repeats(models, isolated_env, tmp_path):
    """As mlx_lm.generate: without --seed, sampled text differs from run to run; with one, it
    repeats (16 tokens at temperature 1 from a random synthetic model: two unseeded runs agree
    by chance with a probability far below one in a billion)."""
    blob_dir = models.blobs()
    runs = {}
    with Daemon(blob_dir, isolated_env, "--cache-gb", "0.01"):
        for name, flags in (("a", ()), ("b", ()), ("c", ("--seed", "4")), ("d", ("--seed", "4"))):
            runs[name], _ = run_generate(blob_dir, isolated_env, tmp_path / f"{name}.json",
                                         "--prompt", PROMPT, "--temp", "1", "-m", "16",
                                         "--ignore-chat-template", *flags)
    assert runs["a"]["tokens"] != runs["b"]["tokens"]
    assert runs["c"]["tokens"] == runs["d"]["tokens"]


def test_verbose_logs_debug_lines_in_the_daemon_and_the_client(models, isolated_env, tmp_path):
    """-v: the detached daemon logs each fill and demand, the client its attach; without -v
    neither does."""
    from harness import expertd_cli

    blob_dir = models.blobs()
    logs = {}
    for verbose in (True, False):
        flags = ["-v"] if verbose else []
        started = expertd_cli(*flags, "start", "--blobs", blob_dir, "--cache-gb", "0.01",
                              timeout=60)
        assert started.returncode == 0, started.stderr
        log = Path(started.stdout.split("log: ", 1)[1].split()[0])
        try:
            # on: auto with the host copy (this CPU) waits per layer where pools miss, so it
            # never replays here (test_step.py tests that).
            done = expertd_cli(*flags, "generate", "--blobs", blob_dir, "--prompt", PROMPT,
                               "-m", "4", "--speculate", "on", timeout=120)
            assert done.returncode == 0, done.stderr
        finally:
            assert expertd_cli("stop", "--blobs", blob_dir, timeout=60).returncode == 0
        logs[verbose] = (log.read_text(), done.stderr)
        log.unlink()
    daemon_log, client_err = logs[True]
    assert " DEBUG fill row " in daemon_log and " DEBUG demand of layer " in daemon_log
    assert " DEBUG attached to expertd pid " in client_err
    # This daemon's cache is small: a speculative step met an expert its pool lacked, and the
    # client says why it replayed it.
    assert re.search(r" DEBUG step \d+ replayed: an expert missed its pool", client_err), client_err
    assert " DEBUG " not in logs[False][0] and " DEBUG " not in logs[False][1]


def test_the_summary_says_when_speculation_paused_and_why(models, isolated_env, tmp_path):
    blob_dir = models.blobs()
    with Daemon(blob_dir, isolated_env, "--cache-gb", "0.01"):
        auto, auto_line = run_generate(blob_dir, isolated_env, tmp_path / "auto.json",
                                       "--prompt", PROMPT, "-m", "48", "--ignore-chat-template")
        off, off_line = run_generate(blob_dir, isolated_env, tmp_path / "off.json", "--prompt",
                                     PROMPT, "--speculate", "off")
    spec = auto["speculation"]
    assert spec["mode"] == "auto" and spec["paused"] >= spec["paused_for_cost"] >= 0
    assert ("(speculation paused" in auto_line) == (spec["paused"] > 0), auto_line
    # This CPU copies on the host: auto speculates only after steps that found their pools
    # whole, and says so while it waits for them.
    assert ("(speculation waiting: the last steps missed their pools" in auto_line) == \
        (spec["waiting"] and not spec["paused"]), auto_line
    assert off["speculation"]["mode"] == "off" and "(--speculate off: a wait per MoE layer)" \
        in off_line


def test_a_saved_prompt_cache_continues_as_in_mlx_lm(models, isolated_env, tmp_path):
    """--prompt-cache-file: mlx_lm.cache_prompt's file for the same model; the prompt follows
    the cached prefix, and the tokens are resident mlx-lm's from the same cache. A cache of
    another model is refused in one line."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

    model_dir, blob_dir = models.model(), models.blobs()
    model, tokenizer = mlx_lm.load(str(model_dir))
    cache = make_prompt_cache(model)
    model(mx.array(tokenizer.encode("The experts of a large model"))[None], cache=cache)
    mx.eval([c.state for c in cache])
    saved = tmp_path / "prefix.safetensors"
    save_prompt_cache(str(saved), cache, {"model": str(model_dir), "chat_template": "",
                                          "tokenizer_config": "{}"})
    want = [r.token for r in mlx_lm.stream_generate(
        model, tokenizer, " live on the disk", max_tokens=8,
        prompt_cache=load_prompt_cache(str(saved)))]
    other = tmp_path / "other.safetensors"
    save_prompt_cache(str(other), cache[:1], {"model": "x", "chat_template": "",
                                              "tokenizer_config": "{}"})
    with Daemon(blob_dir, isolated_env, "--cache-gb", "0.01"):
        got, _ = run_generate(blob_dir, isolated_env, tmp_path / "a.json", "--prompt",
                              " live on the disk", "--ignore-chat-template",
                              "--prompt-cache-file", str(saved))
        refused = subprocess.run([sys.executable, "-m", "expertd", "generate", "--blobs",
                                  str(blob_dir), "--prompt-cache-file", str(other)],
                                 env={**os.environ, **isolated_env}, capture_output=True,
                                 text=True, timeout=120)
    assert got["tokens"] == want
    assert got["prompt_tokens"] == len(tokenizer.encode(" live on the disk"))
    assert refused.returncode == 2 and "made for another model" in refused.stderr
    assert "Traceback" not in refused.stderr
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_text("garbage")
    for path, said in ((garbage, "not a prompt cache mlx-lm can read"),
                       (tmp_path / "none.safetensors", "no such file")):
        with Daemon(blob_dir, isolated_env, "--cache-gb", "0.01"):
            bad = subprocess.run([sys.executable, "-m", "expertd", "generate", "--blobs",
                                  str(blob_dir), "--prompt-cache-file", str(path)],
                                 env={**os.environ, **isolated_env}, capture_output=True,
                                 text=True, timeout=120)
        assert bad.returncode == 2 and said in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1


def test_the_summary_shows_the_pulls_their_rate_and_the_replays_by_cause(models, isolated_env,
                                                                          tmp_path):
    """Pools of top-k rows a layer, a cold cache: the experts missing from the pools are pulled
    (the host's copy here, the device's on a GPU), some were absent from the arena and their
    steps replayed; the summary line says how many rows a step, how fast the prompt's pulls
    went, and the replays by cause, as the JSON counts them."""
    from client_helpers import pool_gb, replay_causes_shown

    blob_dir = models.blobs()
    top_k = Manifest.load(blob_dir).top_k
    with Daemon(blob_dir, isolated_env, "--cache-gb", "0.01"):
        s, line = run_generate(blob_dir, isolated_env, tmp_path / "a.json", "--prompt", PROMPT,
                               "--prefetch", "off", "--pull", "host", "--speculate", "on",
                               "--pool-gb", str(pool_gb(blob_dir, top_k)))
    assert s["pulled_rows"] > 0 and s["pull_s"] > 0 and s["pull_timed_bytes"] > 0
    assert (f"pulled {s['pulled_rows'] / s['steps']:.1f} rows "
            f"({s['pulled_bytes'] / s['steps'] / 2**20:.1f} MiB) a step, prompt pulls at "
            f"{s['pull_timed_bytes'] / s['pull_s'] / 1e9:.1f} GB/s") in line, line
    causes = replay_causes_shown(s)
    assert s["replays_absent"] > 0 and f"{s['replays']} replayed ({causes})" in line, line


def test_min_tokens_to_keep_and_use_default_chat_template_print_what_mlx_lm_generate_prints(
        models, isolated_env, tmp_path):
    """stdout byte for byte as the `mlx_lm generate` command's with the same flags (--verbose
    False: the text alone). --min-p 1 keeps the top token alone, so --min-tokens-to-keep 8 is
    what samples; --use-default-chat-template changes nothing in mlx_lm.generate (mlx-lm 0.32),
    here on a tokenizer with no chat template, where a default one would show."""
    model_dir, blob_dir = models.model(), models.blobs()
    sampled = ("--temp", "1", "--min-p", "1", "--seed", "5", "-m", "16", "--ignore-chat-template")
    runs = {"keep": (*sampled, "--min-tokens-to-keep", "8"), "keep1": sampled,
            "template": ("--use-default-chat-template", "-m", "16")}
    env = {**os.environ, **isolated_env}

    def text(*command):
        done = subprocess.run([sys.executable, "-m", *command, "--prompt", PROMPT, "--verbose",
                               "False"], env=env, stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    want = {name: text("mlx_lm", "generate", "--model", str(model_dir), *flags)
            for name, flags in runs.items()}
    assert want["keep"] != want["keep1"]  # the flag is what changed the sampled text
    with Daemon(blob_dir, isolated_env, "--cache-gb", "0.01"):
        got = {name: text("expertd", "generate", "--blobs", str(blob_dir), *flags)
               for name, flags in runs.items()}
    assert got == want
