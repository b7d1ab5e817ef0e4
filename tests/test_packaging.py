"""The installed package holds every module of the tree: pyproject.toml lists packages by hand
(client/, shm/ and tools/ install under expertd.), and a subpackage left off the list is missing
from a wheel while an editable install, which maps whole folders, still finds it."""

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_folder_is_listed_in_pyproject():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = setup["package-dir"]
    found = set()
    for package, folder in folders.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *rel.parts]))
    # Folders nested in expertd/ that have their own package-dir entry are reached once.
    assert set(setup["packages"]) == found


def test_the_client_library_imports_nothing_of_the_command_line_or_the_daemon():
    """The client shares mode names, defaults and checks through expertd.choices; importing
    every client module loads no module of expertd.cli or expertd.serving."""
    import subprocess
    import sys

    code = ("import sys, expertd.client, expertd.client.serve, expertd.client.generate, "
            "expertd.client.chat, expertd.client.decode, expertd.client.pipeline; "
            "print(sorted(m for m in sys.modules if m.startswith(('expertd.cli.', "
            "'expertd.serving.')) or m in ('expertd.cli', 'expertd.serving')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
