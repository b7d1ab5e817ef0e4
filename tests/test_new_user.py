"""What a new user reads before running a command (issue 44): the help text says where each
part of the output goes (test_generate.py checks that it goes there), and the README says what
`make demo` shows before the first run, and which servers a lazy convert can read."""

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness import expertd_cli, stop_process


def test_generate_help_says_the_summary_goes_to_stdout():
    """mlx_lm.generate's block follows the text on stdout (test_generate.py); only expertd's
    own line goes to stderr."""
    got = expertd_cli("generate", "--help")
    assert got.returncode == 0, got.stderr
    text = " ".join(got.stdout.split())  # argparse wraps the description
    assert ("end as mlx_lm.generate does, with its summary on stdout (tok/s for prompt and "
            "generation, the peak memory), then one line of expertd's on stderr (this client's "
            "hit rate, the bytes the daemon read for it)") in text, text
    assert "summary on stderr" not in text


BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_every_bench_script_answers_help_without_running():
    """A benchmark runs for minutes and writes RESULTS.md: ``--help`` prints its usage and
    exits 0, and an argument it does not take is refused (exit 2), for every script in bench/
    that runs as a program."""
    scripts = sorted(path for path in BENCH.glob("*.py")
                     if '__name__ == "__main__"' in path.read_text())
    assert len(scripts) > 20, scripts
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}  # as a user runs it

    def ask(path: Path, flag: str) -> tuple:
        done = subprocess.run([sys.executable, str(path), flag], capture_output=True, text=True,
                              timeout=120, env=env, cwd=BENCH.parent)
        return path.name, flag, done.returncode, done.stdout, done.stderr

    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda job: ask(*job),
                                [(path, flag) for path in scripts
                                 for flag in ("--help", "--no-such-flag")]))
    for name, flag, code, out, err in answers:
        if flag == "--help":
            assert code == 0 and out.startswith("usage:"), (name, code, out[:200], err[-500:])
        else:
            assert code == 2 and "unrecognized arguments" in err, (name, code, err[-500:])


# ---- the README ---------------------------------------------------------------------------------

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_explains_make_demo_before_the_first_run():
    headings = [line for line in README.read_text().splitlines() if line.startswith("## ")]
    assert headings.index("## What `make demo` shows") + 1 == \
        headings.index("## A first run, without a model"), headings
    assert headings.index("## What `make demo` shows") < headings.index("## Measured")


def test_python_http_server_is_refused_for_lazy_convert_as_the_readme_says(models, tmp_path):
    """The README names `python -m http.server` as a server that ignores Range: a real one,
    on the tiny model's directory, is refused by `convert --lazy` in the line it quotes."""
    server = subprocess.Popen([sys.executable, "-u", "-m", "http.server", "0", "--bind",
                               "127.0.0.1"], cwd=models.model(), stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        port = re.search(r" port (\d+) ", server.stdout.readline()).group(1)
        out = tmp_path / "lazy"
        got = expertd_cli("convert", "--lazy", "-q", f"http://127.0.0.1:{port}/", out)
    finally:
        stop_process(server)
    assert got.returncode == 1 and not out.exists(), got
    refusal = "the server ignores Range requests (HTTP 200, not 206)"
    assert got.stderr.strip().endswith(refusal), got.stderr
    readme = " ".join(README.read_text().split())
    assert ("`python -m http.server` does not (it answers 200 with the whole file" in readme
            and f"`convert --lazy` refuses it at once (`{refusal}`)" in readme)
