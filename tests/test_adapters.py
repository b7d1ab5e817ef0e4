"""mlx-lm's load flags on a streamed model (issue 26). LoRA adapters: the trunk's adapters load
as mlx-lm loads them, and the logits are resident mlx-lm's with the same adapters, bit for bit;
adapters of the routed experts, a full fine-tune and a folder without adapters are refused by
name. trust_remote_code: a model of its own code loads only when trusted, exactly."""

import json

import mlx.core as mx
import mlx_lm
import pytest
from client_helpers import client_daemon, prompt_ids
from mlx.utils import tree_flatten

from expertd.client import load

TRUNK_KEYS = ["self_attn.q_proj", "self_attn.o_proj"]


def write_adapters(model_dir, out, keys, kind="lora"):
    """Adapters as mlx_lm.lora writes them, for the last 2 blocks, with random (non-zero)
    weights so that they change the logits."""
    model = mlx_lm.load(str(model_dir))[0]
    from mlx_lm.tuner.utils import linear_to_lora_layers

    lora = {"rank": 4, "scale": 4.0, "dropout": 0.0, "keys": keys}
    linear_to_lora_layers(model, 2, lora)
    mx.random.seed(5)
    weights = {name: mx.random.normal(p.shape).astype(p.dtype) * 0.05
               for name, p in tree_flatten(model.parameters())
               if name.rsplit(".", 1)[-1] in ("lora_a", "lora_b")}
    assert weights
    out.mkdir()
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    (out / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": kind, "num_layers": 2, "lora_parameters": lora}))
    return out


def test_trunk_adapters_give_resident_logits_with_the_same_adapters(qwen, isolated_env,
                                                                     tmp_path):
    adapters = write_adapters(qwen.model_dir, tmp_path / "adapters", TRUNK_KEYS)
    resident = mlx_lm.load(str(qwen.model_dir), adapter_path=str(adapters))[0]
    ids = mx.array([prompt_ids(12, qwen.resident.args.vocab_size, 3)])
    plain = qwen.resident(ids)
    with client_daemon(qwen.blob_dir, isolated_env, tmp_path):
        model, _ = load(qwen.blob_dir, adapter_path=adapters)
        try:
            got, want = model(ids), resident(ids)
            mx.eval(got, want, plain)
            assert not mx.array_equal(want, plain).item()  # the adapters change the logits
            assert mx.array_equal(got, want).item()
        finally:
            model.expertd_session.close()


@pytest.mark.parametrize("case", ["experts", "default-keys", "full", "empty"])
def test_adapters_a_streamed_model_cannot_take_are_refused_by_name(qwen, isolated_env,
                                                                   tmp_path, case):
    where = tmp_path / "adapters"
    if case == "experts":
        write_adapters(qwen.model_dir, where, ["mlp.switch_mlp.gate_proj"])
        why = "train the routed experts (model.layers."
    elif case == "default-keys":  # mlx-lm's default adapts every linear, experts included
        write_adapters(qwen.model_dir, where, None)
        why = "train the routed experts"
    elif case == "full":
        write_adapters(qwen.model_dir, where, TRUNK_KEYS, kind="full")
        why = "a full fine-tune is a model of its own"
    else:
        where.mkdir()
        why = "no adapter_config.json and adapters.safetensors there"
    with client_daemon(qwen.blob_dir, isolated_env, tmp_path):
        with pytest.raises(ValueError, match="--adapter-path") as refused:
            load(qwen.blob_dir, adapter_path=where)
    assert why in str(refused.value) and str(where) in str(refused.value)


def test_generate_with_adapters_writes_mlx_lms_text_with_them(qwen, isolated_env, tmp_path):
    """``expertd generate --adapter-path`` prints what mlx-lm's own generation prints with the
    same adapters (and not what it prints without them)."""
    import os
    import subprocess
    import sys

    adapters = write_adapters(qwen.model_dir, tmp_path / "adapters", TRUNK_KEYS)
    model, tokenizer = mlx_lm.load(str(qwen.model_dir), adapter_path=str(adapters))
    prompt, n = "The adapters", 12
    want = "".join(r.text for r in mlx_lm.stream_generate(model, tokenizer, prompt,
                                                           max_tokens=n))
    plain = "".join(r.text for r in mlx_lm.stream_generate(qwen.resident, qwen.tokenizer,
                                                            prompt, max_tokens=n))
    assert want != plain
    with client_daemon(qwen.blob_dir, isolated_env, tmp_path):
        done = subprocess.run(
            [sys.executable, "-m", "expertd", "generate", "--blobs", str(qwen.blob_dir), "-p",
             prompt, "-m", str(n), "--adapter-path", str(adapters), "--verbose", "False"],
            env={**os.environ, **isolated_env}, stdin=subprocess.DEVNULL,
            capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == want + "\n"


def test_serve_with_adapters_answers_mlx_lms_text_with_them(qwen, isolated_env, tmp_path):
    """``expertd serve --adapter-path`` answers with the adapters applied, and refuses a
    request that names other adapters."""
    from test_serve import Server

    adapters = write_adapters(qwen.model_dir, tmp_path / "adapters", TRUNK_KEYS)
    model, tokenizer = mlx_lm.load(str(qwen.model_dir), adapter_path=str(adapters))
    prompt, n = "The adapters", 8
    want = "".join(r.text for r in mlx_lm.stream_generate(model, tokenizer, prompt,
                                                           max_tokens=n))
    with client_daemon(qwen.blob_dir, isolated_env, tmp_path):
        with Server(qwen.blob_dir, tmp_path, "--adapter-path", adapters) as server:
            got = server.client.completions.create(model="default_model", prompt=prompt,
                                                   max_tokens=n, temperature=0.0)
            assert got.choices[0].text == want
            import openai

            with pytest.raises(openai.APIStatusError) as refused:
                server.client.completions.create(model="default_model", prompt=prompt,
                                                 max_tokens=n,
                                                 extra_body={"adapters": "elsewhere"})
            # The caller's error, naming the parameter (mlx_lm.server answers 404 not found)
            assert refused.value.status_code == 400, refused.value
            assert refused.value.response.json()["error"]["param"] == "adapters"
            assert "--adapter-path" in str(refused.value)


def test_a_model_of_its_own_code_loads_only_when_trusted(isolated_env, tmp_path):
    """A checkpoint whose config names a ``model_file`` (its own class) is refused without
    trust_remote_code, saying which flag loads it, and loads exactly with it."""
    from harness import Daemon

    from expertd.errors import BlobStoreError
    from expertd.tools.convert import convert
    from expertd.tools.synth import SynthConfig, synthesize

    model_dir = synthesize(SynthConfig(layers=2, experts=8, top_k=2), tmp_path / "m",
                           progress=False)
    (model_dir / "custom.py").write_text(
        "from mlx_lm.models.qwen3_moe import Model as Base, ModelArgs  # noqa: F401\n\n\n"
        "class Model(Base):\n    pass\n")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "model_file": "custom.py"}))
    blob_dir = tmp_path / "b"
    convert(model_dir, blob_dir, progress=False)
    resident = mlx_lm.load(str(model_dir), trust_remote_code=True)[0]
    assert type(resident).__name__ == "Model" and type(resident).__module__ == "custom_model"
    ids = mx.array([prompt_ids(9, resident.args.vocab_size, 1)])
    with Daemon(blob_dir, isolated_env, "--cache-gb", "0.05"):
        with pytest.raises(BlobStoreError, match="--trust-remote-code") as refused:
            load(blob_dir)
        assert "custom.py" in str(refused.value)
        model, _ = load(blob_dir, trust_remote_code=True)
        try:
            assert any(c.__module__ == "custom_model" for c in type(model).__mro__)
            got, want = model(ids), resident(ids)
            mx.eval(got, want)
            assert mx.array_equal(got, want).item()
        finally:
            model.expertd_session.close()


def test_sampled_generate_with_adapters_and_a_seed_is_mlx_lms(qwen, isolated_env, tmp_path):
    """mlx_lm.generate seeds before it loads, and adapters draw their initial values from the
    seeded key: generate seeds at the same point, so sampled text with --seed is the same."""
    import os
    import subprocess
    import sys

    from mlx_lm.sample_utils import make_sampler

    adapters = write_adapters(qwen.model_dir, tmp_path / "adapters", TRUNK_KEYS)
    prompt, n = "The adapters", 16
    mx.random.seed(11)  # as mlx_lm.generate --seed 11 --temp 1: seeded, then loaded
    model, tokenizer = mlx_lm.load(str(qwen.model_dir), adapter_path=str(adapters))
    want = "".join(r.text for r in mlx_lm.stream_generate(
        model, tokenizer, prompt, max_tokens=n, sampler=make_sampler(1.0)))
    with client_daemon(qwen.blob_dir, isolated_env, tmp_path):
        done = subprocess.run(
            [sys.executable, "-m", "expertd", "generate", "--blobs", str(qwen.blob_dir), "-p",
             prompt, "-m", str(n), "--adapter-path", str(adapters), "--verbose", "False",
             "--temp", "1", "--seed", "11", "--ignore-chat-template"],
            env={**os.environ, **isolated_env}, stdin=subprocess.DEVNULL,
            capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == want + "\n"


@pytest.mark.parametrize("case", ["garbage", "empty", "rank"])
def test_unreadable_adapters_are_refused_in_one_line(qwen, isolated_env, tmp_path, case):
    """Adapters that mlx cannot read, or a config whose values have the wrong types, are
    refused naming --adapter-path and the file, not with mlx's own exception."""
    where = write_adapters(qwen.model_dir, tmp_path / "adapters", TRUNK_KEYS)
    if case in ("garbage", "empty"):
        (where / "adapters.safetensors").write_bytes(b"\x00garbage" * 9 if case == "garbage"
                                                     else b"")
        why = "adapters.safetensors is not a safetensors file"
    else:
        config = json.loads((where / "adapter_config.json").read_text())
        config["lora_parameters"]["rank"] = "four"
        (where / "adapter_config.json").write_text(json.dumps(config))
        why = "adapter_config.json does not fit this model"
    with client_daemon(qwen.blob_dir, isolated_env, tmp_path) as daemon:
        with pytest.raises(ValueError, match="--adapter-path") as refused:
            load(qwen.blob_dir, adapter_path=where)
        assert daemon.stats()["clients"] == 0  # the session said goodbye
    assert why in str(refused.value) and str(where) in str(refused.value)


@pytest.mark.parametrize("code", ["raise RuntimeError('boom on import')\n", "def (:\n",
                                  "x = 1\n"])
def test_a_model_whose_own_code_fails_is_refused_naming_it(isolated_env, tmp_path, code):
    """Trusted code that raises, does not parse or lacks Model: one error naming the file."""
    from harness import Daemon

    from expertd.errors import BlobStoreError
    from expertd.tools.convert import convert
    from expertd.tools.synth import SynthConfig, synthesize

    model_dir = synthesize(SynthConfig(layers=2, experts=8, top_k=2), tmp_path / "m",
                           progress=False)
    (model_dir / "custom.py").write_text(code)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "model_file": "custom.py"}))
    blob_dir = tmp_path / "b"
    convert(model_dir, blob_dir, progress=False)  # the code is copied, never run
    with Daemon(blob_dir, isolated_env, "--cache-gb", "0.05"):
        with pytest.raises(BlobStoreError, match="custom.py") as refused:
            load(blob_dir, trust_remote_code=True)
    assert "--trust-remote-code" in str(refused.value)


def test_generate_refusing_its_adapters_prints_nothing_on_stdout(qwen, isolated_env, tmp_path):
    """As mlx_lm.generate: its rule line comes once the model is loaded, so a load that fails
    leaves stdout empty, and the error is one line on stderr."""
    import os
    import subprocess
    import sys

    (tmp_path / "empty").mkdir()
    with client_daemon(qwen.blob_dir, isolated_env, tmp_path):
        done = subprocess.run(
            [sys.executable, "-m", "expertd", "generate", "--blobs", str(qwen.blob_dir), "-p",
             "hi", "--adapter-path", str(tmp_path / "empty")],
            env={**os.environ, **isolated_env}, stdin=subprocess.DEVNULL,
            capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (2, ""), done
    assert done.stderr.count("\n") == 1 and "--adapter-path" in done.stderr
