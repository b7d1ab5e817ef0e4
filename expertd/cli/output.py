"""How a command says its last words: one place for the command line and the library alike."""

import os
import sys


def mute_stdout() -> None:
    """After a reader has gone: stdout goes to devnull, so that the interpreter's last flush
    of what is still buffered cannot fail again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def answer(text: str, code: int, file=None) -> int:
    """Print a command's last words and return its exit code, which a reader that has gone
    does not change (status's 3 stays 3 under `| true`)."""
    try:
        print(text, file=file or sys.stdout, flush=True)
    except BrokenPipeError:
        mute_stdout()
    return code
