"""``expertd chat``: mlx_lm.chat's loop on a model whose experts stream through expertd.

``mlx_lm.chat.main`` loads its model itself, so its loop is repeated here, turn for turn: the
same commands (q, r, h), the same chat template use, one KV cache kept across turns, and, in a
terminal, mlx-lm's own ChatUI. When stdin or stdout is not a terminal (a pipe, a test), the
replies alone go to stdout and the rest to stderr, and the end of the input quits. Ctrl-C stops
a reply and returns to the prompt, as Ollama and mlx_lm.chat users expect; at the prompt it
quits.
"""

import os
import signal
import sys
from contextlib import nullcontext
from functools import partial
from types import SimpleNamespace

from expertd.choices import CHAT_XTC_THRESHOLD, DEFAULT_PREFILL_STEP_SIZE

QUIT, RESET, HELP = {"q", "/q", "/quit", "/exit"}, {"r", "/r"}, {"h", "/h", "/help"}
HELP_TEXT = ("commands: q quit, r reset the conversation, h help (end of input quits too; "
             "Ctrl-C stops a reply)")


class PlainUI:
    """ChatUI's methods for pipes: no panels, no cursor moves, replies alone on stdout."""

    def __init__(self, out=sys.stdout, err=sys.stderr):
        self.out, self.err = out, err

    def _say(self, line: str) -> None:
        # One write per line, so that a Ctrl-C never leaves half of one.
        self.err.write(line + "\n")
        self.err.flush()

    def __enter__(self):
        self._say(HELP_TEXT)
        return self

    def __exit__(self, *exc):
        return False

    def prompt(self) -> str:
        return input()

    def say_bye(self):
        self._say("bye")

    def say_reset(self):
        self._say("reset: context cleared")

    def say_help(self):
        self._say(HELP_TEXT)

    def stream_token(self, text: str):
        self.out.write(text)
        self.out.flush()

    def say_interrupted(self, note: str):
        self.out.write("\n")  # end the cut reply's line
        self.out.flush()
        self._say(f"interrupted: {note}")

    def end_turn(self, response):
        self.out.write("\n")
        self.out.flush()
        if response is not None:
            self._say(f"  {response.generation_tokens} tokens · {response.generation_tps:.1f} "
                      f"tok/s · prompt {response.prompt_tps:.1f} tok/s")


def _ui(blob_dir, max_tokens: int, system_prompt: str | None, adapter_path=None):
    if sys.stdin.isatty() and sys.stdout.isatty():
        return _terminal_ui(SimpleNamespace(model=str(blob_dir), adapter_path=adapter_path,
                                            max_tokens=max_tokens, system_prompt=system_prompt))
    return PlainUI()


def _terminal_ui(args):
    """mlx-lm's ChatUI, which has no word for an interrupted reply: one is added."""
    from mlx_lm.cli_ui import ChatUI, make_console
    from rich.markup import escape

    class TerminalUI(ChatUI):
        ended_early = False  # the last prompt ended without Enter (Ctrl-D, Ctrl-C)

        def prompt(self) -> str:
            self.ended_early = True
            line = super().prompt()
            self.ended_early = False
            return line

        def say_bye(self):
            if self.ended_early:  # the cursor sits on the prompt's bottom rule: step past it
                sys.stdout.write("\n")
                sys.stdout.flush()
            super().say_bye()

        def say_interrupted(self, note: str):
            print(flush=True)  # end the cut reply's line
            make_console().print(f"  [ui.warn]interrupted[/ui.warn] [ui.muted]{escape(note)}"
                                 "[/ui.muted]")

    return TerminalUI(args)


def chat(blob_dir, system_prompt: str | None = None, max_tokens: int = 256, temp: float = 0.0,
         top_p: float = 1.0, seed: int = 0, max_kv_size: int | None = None,
         prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE, prefetch: str = "auto",
         pool_gb: float | None = None, speculate: str = "auto", pull: str = "auto",
         reconnect_timeout: float | None = None, adapter_path: str | None = None,
         trust_remote_code: bool = False, xtc_probability: float = 0.0,
         xtc_threshold: float = CHAT_XTC_THRESHOLD, pipeline_group=None) -> int:
    """Chat with the model of ``blob_dir`` until q, Ctrl-C at the prompt or the end of the input.

    Ctrl-C during a reply stops it and forgets its turn: the KV cache is trimmed back to where
    the turn began (or, where it cannot be, the conversation starts again, and the UI says so).

    Args:
        blob_dir: a blob directory served by a running daemon.
        system_prompt: put first in every turn's messages, as mlx_lm.chat does.
        max_tokens, temp, top_p, seed, max_kv_size, prefill_step_size, xtc_probability,
            xtc_threshold: as in mlx_lm.chat.
        prefetch: the client's prefetch mode (see ``expertd.client.load``).
        pool_gb: the client's expert pools (see ``expertd.client.load``).
        speculate: one host wait per decode step (see ``expertd.client.load``).
        pipeline_group: under mlx.launch, the ranks' group: this process runs its rank's
            pipeline stage, as mlx_lm.chat --pipeline. Every rank reads the same input (mlx.launch
            copies it to each) and computes the same tokens; rank 0 prints. SIGINT and SIGTERM
            end a rank at once, as Ctrl-C ends mlx_lm.chat: a reply stopped on one rank
            alone would leave the others waiting for its stage.
    Returns:
        0 (the session is closed with a goodbye to the daemon, whatever happens).
    Raises:
        DaemonNotRunning: no daemon serves ``blob_dir`` (the message says how to start one).
    """
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    from expertd.client import load
    from expertd.client.decode import stream_generate  # mlx-lm's, on expertd's pipelined step
    from expertd.client.generate import xtc_special_tokens

    mx.random.seed(seed)  # before the load, as mlx_lm.chat (building the model draws from it)
    if pipeline_group is not None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    model, tokenizer = load(blob_dir, prefetch=prefetch, pool_gb=pool_gb,
                            pipeline_group=pipeline_group,
                            speculate=speculate, pull=pull, adapter_path=adapter_path,
                            trust_remote_code=trust_remote_code,
                            **({} if reconnect_timeout is None
                               else {"reconnect_timeout": reconnect_timeout}))
    session = model.expertd_session
    try:
        sampler = make_sampler(temp, top_p, xtc_probability=xtc_probability,
                               xtc_threshold=xtc_threshold,
                               xtc_special_tokens=xtc_special_tokens(tokenizer))

        def replies(query: str, prompt_cache):
            return stream_generate(model, tokenizer, _prompt(tokenizer, query, system_prompt),
                                   max_tokens=max_tokens, sampler=sampler,
                                   prompt_cache=prompt_cache,
                                   prefill_step_size=prefill_step_size)

        if pipeline_group is not None and pipeline_group.rank() != 0:
            ui = PlainUI(*[open(os.devnull, "w")] * 2)  # it reads its copy of the input
        else:
            ui = _ui(blob_dir, max_tokens, system_prompt, adapter_path)
        with ui:
            prompt_cache = make_prompt_cache(model, max_kv_size)
            ended = None  # how the last turn ended, said at the prompt
            while True:
                # From the end of a turn on, a Ctrl-C quits, as q does.
                try:
                    if ended is not None:
                        ended()
                        ended = None
                    query = ui.prompt()
                    command = query.strip()
                    if command in RESET:
                        prompt_cache = make_prompt_cache(model, max_kv_size)
                        ui.say_reset()
                        continue
                    if command in HELP:
                        ui.say_help()
                        continue
                except (EOFError, KeyboardInterrupt):
                    command = "q"
                if command in QUIT:
                    ui.say_bye()
                    break
                ended, prompt_cache = _reply(ui, partial(replies, query), prompt_cache,
                                             partial(make_prompt_cache, model, max_kv_size),
                                             stoppable=pipeline_group is None)
        if pipeline_group is not None:
            _leave_pipeline(pipeline_group)
    finally:
        session.close()
    return 0


def _leave_pipeline(group) -> None:
    """Wait for the last reply's sends between stages (mlx-lm evaluates a step ahead on its own
    stream), then leave with the other ranks (see pipeline.leave_together)."""
    import importlib

    import mlx.core as mx

    from expertd.client.pipeline import leave_together

    mx.synchronize()
    mx.synchronize(importlib.import_module("mlx_lm.generate").generation_stream)
    leave_together(group)


def _reply(ui, replies, prompt_cache, new_cache, stoppable: bool = True) -> tuple:
    """Stream one reply: ``replies(prompt_cache)`` gives mlx-lm's responses.

    A Ctrl-C stops the reply at the next token, never inside a forward pass, where it would cut
    the client's pool and request bookkeeping in two; a second one raises KeyboardInterrupt.
    Unless ``stoppable``, SIGINT keeps its handler (a pipeline's: it ends the process).

    Returns:
        How the turn ended, to say at the next prompt, and the KV cache to go on with: after a
        Ctrl-C, the same one trimmed back to where the turn began, or ``new_cache()`` where it
        cannot be.
    """
    before, last = _offsets(prompt_cache), None
    with _StopAtNextToken() if stoppable else nullcontext(SimpleNamespace(requested=False)) \
            as stop:
        responses = replies(prompt_cache)
        try:
            for response in responses:
                ui.stream_token(response.text)
                last = response
                if stop.requested:
                    break
        finally:
            responses.close()  # mlx-lm's generator cleans up (its wired limit)
    if not stop.requested:
        return partial(ui.end_turn, last), prompt_cache
    if _rewind(prompt_cache, before):
        note = "the turn is dropped from the conversation"
    else:
        prompt_cache = new_cache()
        note = "context cleared (the KV cache could not be trimmed back)"
    return partial(ui.say_interrupted, note), prompt_cache


class _StopAtNextToken:
    """While a reply streams, the first SIGINT only asks it to stop; the next one interrupts."""

    def __enter__(self):
        self.requested = False
        self._previous = signal.signal(signal.SIGINT, self._request)
        return self

    def _request(self, signum, frame) -> None:
        self.requested = True
        signal.signal(signal.SIGINT, self._previous)

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self._previous)


def _leaves(prompt_cache) -> list:
    """Every layer's cache, a CacheList's parts one by one."""
    leaves = []
    for c in prompt_cache:
        leaves.extend(_leaves(c.caches) if hasattr(c, "caches") else [c])
    return leaves


def _offsets(prompt_cache) -> list:
    return [c.offset if isinstance(getattr(c, "offset", None), int) else None
            for c in _leaves(prompt_cache)]


def _rewind(prompt_cache, offsets: list) -> bool:
    """Trim every cache back to ``offsets``, each layer's own (a model may mix cache kinds).
    False, and nothing trimmed, if one cannot be."""
    leaves = _leaves(prompt_cache)
    if len(leaves) != len(offsets) or any(
            before is None or not c.is_trimmable() or c.offset < before
            for c, before in zip(leaves, offsets)):
        return False
    for c, before in zip(leaves, offsets):
        c.trim(c.offset - before)
    return True


def _prompt(tokenizer, query: str, system_prompt: str | None):
    """This turn's tokens: the chat template over [system], user (the KV cache holds the rest).
    A tokenizer without a template gets the text as it is."""
    if not tokenizer.has_chat_template:
        return query if system_prompt is None else f"{system_prompt}\n{query}"
    messages = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    messages.append({"role": "user", "content": query})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
