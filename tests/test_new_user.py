"""What a new user reads before running a command (issue 44): the help text says where each
part of the output goes (test_generate.py checks that it goes there), and the README says what
`make demo` shows before the first run."""

from pathlib import Path

from harness import expertd_cli


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


# ---- the README ---------------------------------------------------------------------------------

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_explains_make_demo_before_the_first_run():
    headings = [line for line in README.read_text().splitlines() if line.startswith("## ")]
    assert headings.index("## What `make demo` shows") + 1 == \
        headings.index("## A first run, without a model"), headings
    assert headings.index("## What `make demo` shows") < headings.index("## Measured")

