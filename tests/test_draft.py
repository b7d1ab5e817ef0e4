"""Speculative decoding with a draft model (mlx-lm's own) on a streamed model.

A small resident draft proposes tokens, and the streamed model checks several in one call: its
misses cost once per call, not once per token. Every token, its log-probabilities and whether
the draft made it equal resident mlx-lm's with the same draft, bit for bit, whether the arena
holds every expert or a few rows; and ``expertd generate --draft-model`` prints the same text.
"""

import json
import subprocess
import sys

import mlx.core as mx
import pytest
from client_helpers import ROWS_ALL, ROWS_TINY, client_flags, routed_model
from harness import Daemon
from mlx_lm.generate import speculative_generate_step
from test_decode import prompt, streamed
from test_step import resident_model

TOKENS = 20
DRAFTS = 3


def draft_dir(models):
    """Another checkpoint of the same vocabulary (8-bit): its guesses are sometimes wrong, so
    both the accepted and the rejected branches of mlx-lm's loop run."""
    return models.model(family="qwen3_moe", mode="affine", bits=8)


def steps(model, draft, ids) -> list:
    return list(speculative_generate_step(ids, model, draft, num_draft_tokens=DRAFTS,
                                          max_tokens=TOKENS))


@pytest.mark.parametrize("arena_rows", [ROWS_ALL, ROWS_TINY])
def test_a_draft_model_checked_by_the_streamed_one_gives_resident_tokens(
        models, isolated_env, tmp_path, arena_rows):
    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    draft = resident_model(draft_dir(models))
    ids = prompt(resident_model(model_dir).args.vocab_size)
    want = steps(resident_model(model_dir), draft, ids)
    assert any(d for _, _, d in want) and not all(d for _, _, d in want)
    with Daemon(blob_dir, isolated_env, *client_flags(blob_dir, arena_rows, tmp_path / "s.json")):
        model = streamed(blob_dir)
        session = model.expertd_session
        try:
            got = steps(model, draft, ids)
            assert [(t, d) for t, _, d in got] == [(t, d) for t, _, d in want]
            for i, ((_, a, _), (_, b, _)) in enumerate(zip(got, want)):
                assert mx.array_equal(a, b).item(), f"token {i}: log-probabilities differ"
            # Several tokens a call: fewer model calls than tokens.
            assert session.counters["steps"] < TOKENS
        finally:
            session.close()


def test_generate_takes_a_draft_model_and_prints_resident_text(models, isolated_env, tmp_path):
    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    draft = draft_dir(models)
    text = "Tell me about experts"
    import mlx_lm

    resident, tokenizer = mlx_lm.load(str(model_dir))
    want = [r.token for r in mlx_lm.stream_generate(
        resident, tokenizer, text, max_tokens=TOKENS, draft_model=resident_model(draft),
        num_draft_tokens=DRAFTS)]
    summary = tmp_path / "summary.json"
    with Daemon(blob_dir, isolated_env, *client_flags(blob_dir, ROWS_ALL, tmp_path / "s.json")):
        run = subprocess.run(
            [sys.executable, "-m", "expertd", "generate", "--blobs", str(blob_dir),
             "--prompt", text, "--ignore-chat-template", "--max-tokens", str(TOKENS),
             "--draft-model", str(draft), "--num-draft-tokens", str(DRAFTS),
             "--json-summary", str(summary)],
            env=isolated_env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    got = json.loads(summary.read_text())
    assert got["tokens"] == want
    assert got["draft_accepted"] > 0 and "drafted" in run.stderr


def test_generate_refuses_a_draft_whose_vocabulary_differs(models, isolated_env, tmp_path):
    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    with Daemon(blob_dir, isolated_env):  # (without one, that is what generate says first)
        run = subprocess.run(
            [sys.executable, "-m", "expertd", "generate", "--blobs", str(blob_dir), "--prompt",
             "x", "--draft-model", str(tmp_path / "nothing-here")],
            env=isolated_env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "draft" in run.stderr and "Traceback" not in run.stderr


def test_serve_takes_a_draft_model_and_answers_resident_tokens(models, isolated_env, tmp_path):
    """mlx_lm.server's speculative decoding, through ``expertd serve --draft-model``: a greedy
    completion's tokens equal resident mlx-lm's with the same draft."""
    import mlx_lm
    from client_helpers import parse_metrics
    from test_serve import Server, reply_tokens

    blob_dir, model_dir = models.blobs(), models.model()
    draft = models.model(bits=8)
    resident, tokenizer = mlx_lm.load(str(model_dir))
    want = [r.token for r in mlx_lm.stream_generate(
        resident, tokenizer, "def main(): print(", max_tokens=TOKENS,
        draft_model=resident_model(draft), num_draft_tokens=DRAFTS)]
    with (Daemon(blob_dir, isolated_env, *client_flags(blob_dir, ROWS_ALL, tmp_path / "s.json")),
          Server(blob_dir, tmp_path, "--draft-model", draft) as server):
        reply = server.client.completions.create(model=blob_dir.name, prompt="def main(): print(",
                                                 max_tokens=TOKENS, temperature=0, logprobs=True)
        values, _ = parse_metrics(server.get("/metrics")[2])
    assert reply_tokens(reply.choices[0]) == want
    # Drafted tokens checked several at a call: fewer model calls than tokens (the prompt's
    # calls included).
    assert values["expertd_client_steps_total"] < len(want)


def test_a_mistyped_draft_model_is_not_sent_to_the_network():
    """A name that is neither here nor a Hugging Face id (ORG/NAME) was handed to the Hub,
    and the user read a DNS error."""
    from expertd.client.generate import load_draft

    for name in ("nosuchdir", "a/b/c", "./draft", "~/nowhere/draft"):
        with pytest.raises(ValueError, match="no such directory .nor a Hugging Face id"):
            load_draft(name)
