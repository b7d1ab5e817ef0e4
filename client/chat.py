"""``expertd chat``: mlx_lm.chat's loop on a model whose experts stream through expertd.

``mlx_lm.chat.main`` loads its model itself, so its loop is repeated here, turn for turn: the
same commands (q, r, h), the same chat template use, one KV cache kept across turns, and, in a
terminal, mlx-lm's own ChatUI. When stdin or stdout is not a terminal (a pipe, a test), the
replies alone go to stdout and the rest to stderr, and the end of the input quits.
"""

import sys
from types import SimpleNamespace

QUIT, RESET, HELP = {"q", "/q", "/quit", "/exit"}, {"r", "/r"}, {"h", "/h", "/help"}
HELP_TEXT = "commands: q quit, r reset the conversation, h help (end of input quits too)"


class PlainUI:
    """ChatUI's methods for pipes: no panels, no cursor moves, replies alone on stdout."""

    def __init__(self, out=sys.stdout, err=sys.stderr):
        self.out, self.err = out, err

    def __enter__(self):
        print(HELP_TEXT, file=self.err, flush=True)
        return self

    def __exit__(self, *exc):
        return False

    def prompt(self) -> str:
        return input()

    def say_bye(self):
        print("bye", file=self.err, flush=True)

    def say_reset(self):
        print("reset: context cleared", file=self.err, flush=True)

    def say_help(self):
        print(HELP_TEXT, file=self.err, flush=True)

    def stream_token(self, text: str):
        self.out.write(text)
        self.out.flush()

    def end_turn(self, response):
        self.out.write("\n")
        self.out.flush()
        if response is not None:
            print(f"  {response.generation_tokens} tokens · {response.generation_tps:.1f} tok/s "
                  f"· prompt {response.prompt_tps:.1f} tok/s", file=self.err, flush=True)


def _ui(blob_dir, max_tokens: int, system_prompt: str | None):
    if sys.stdin.isatty() and sys.stdout.isatty():
        from mlx_lm.cli_ui import ChatUI

        return ChatUI(SimpleNamespace(model=str(blob_dir), adapter_path=None,
                                      max_tokens=max_tokens, system_prompt=system_prompt))
    return PlainUI()


def chat(blob_dir, system_prompt: str | None = None, max_tokens: int = 256, temp: float = 0.0,
         top_p: float = 1.0, seed: int = 0, max_kv_size: int | None = None,
         prefetch: str = "auto", pool_gb: float | None = None,
         speculate: str = "auto") -> int:
    """Chat with the model of ``blob_dir`` until q or the end of the input.

    Args:
        blob_dir: a blob directory served by a running daemon.
        system_prompt: put first in every turn's messages, as mlx_lm.chat does.
        max_tokens, temp, top_p, seed, max_kv_size: as in mlx_lm.chat.
        prefetch: the client's prefetch mode (see ``expertd.client.load``).
        pool_gb: the client's expert pools (see ``expertd.client.load``).
        speculate: one host wait per decode step (see ``expertd.client.load``).
    Returns:
        0 (the session is closed with a goodbye to the daemon, whatever happens).
    Raises:
        DaemonNotRunning: no daemon serves ``blob_dir`` (the message says how to start one).
    """
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    from expertd.client import load

    model, tokenizer = load(blob_dir, prefetch=prefetch, pool_gb=pool_gb,
                            speculate=speculate)
    session = model.expertd_session
    try:
        mx.random.seed(seed)
        sampler = make_sampler(temp, top_p)
        with _ui(blob_dir, max_tokens, system_prompt) as ui:
            prompt_cache = make_prompt_cache(model, max_kv_size)
            while True:
                try:
                    query = ui.prompt()
                except EOFError:
                    ui.say_bye()
                    break
                command = query.strip()
                if command in QUIT:
                    ui.say_bye()
                    break
                if command in RESET:
                    prompt_cache = make_prompt_cache(model, max_kv_size)
                    ui.say_reset()
                    continue
                if command in HELP:
                    ui.say_help()
                    continue
                last = None
                for response in stream_generate(model, tokenizer,
                                                _prompt(tokenizer, query, system_prompt),
                                                max_tokens=max_tokens, sampler=sampler,
                                                prompt_cache=prompt_cache):
                    ui.stream_token(response.text)
                    last = response
                ui.end_turn(last)
    finally:
        session.close()
    return 0


def _prompt(tokenizer, query: str, system_prompt: str | None):
    """This turn's tokens: the chat template over [system], user (the KV cache holds the rest).
    A tokenizer without a template gets the text as it is."""
    if not tokenizer.has_chat_template:
        return query if system_prompt is None else f"{system_prompt}\n{query}"
    messages = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    messages.append({"role": "user", "content": query})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
