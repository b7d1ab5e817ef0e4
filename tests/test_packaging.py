"""The installed package holds every module of the tree: pyproject.toml lists packages by hand
(client/, shm/ and tools/ install under expertd.), and a subpackage left off the list is missing
from a wheel while an editable install, which maps whole folders, still finds it."""

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later

ROOT = Path(__file__).resolve().parent.parent
# The product's folders, by the installed package's names (client/, shm/ and tools/ map into
# expertd).
PRODUCT_TREES = {"expertd": ROOT / "expertd", "expertd.client": ROOT / "client",
                 "expertd.shm": ROOT / "shm", "expertd.tools": ROOT / "tools"}


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


def _parsed_product_files() -> dict:
    """Every product module's path -> its parsed tree."""
    import ast

    return {path: ast.parse(path.read_text())
            for folder in PRODUCT_TREES.values() for path in folder.rglob("*.py")}


def _import_graph() -> dict:
    """Product modules (the installed package's names: client/, shm/ and tools/ map into
    expertd) -> the product modules each imports, function-level imports included."""
    import ast

    files = {}
    for package, folder in PRODUCT_TREES.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            files[".".join([package, *parts])] = path
    graph = {}
    for name, path in files.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
                targets.add(base)
                targets.update(f"{base}.{a.name}" for a in node.names)
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def test_the_product_code_imports_in_no_circle():
    """An import graph of the product code, function-level imports included, has no circle
    (issue 25): every strongly connected part is one module."""
    graph = _import_graph()
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while not part or part[-1] != v:
                part.append(stack.pop())
                on.discard(part[-1])
            if len(part) > 1:
                circles.append(sorted(part))

    for v in graph:
        if v not in index:
            visit(v)
    assert "expertd.cli.main" in graph and graph["expertd.cli.main"]  # the graph is read
    assert circles == []


# The client's upper floor: the step and what runs it, and the model's front ends.
ABOVE_THE_SESSION = ("step", "switch", "predict", "layer", "decode", "batch", "loader", "serve",
                     "chat", "generate")


def test_the_session_imports_nothing_above_it():
    """The session is a floor below the step (issue 43): neither session.py nor any client
    module it reaches through its imports imports the step or what sits above it."""
    reached, found = _below("expertd.client.session", ABOVE_THE_SESSION)
    assert {"expertd.client.attach", "expertd.client.requester"} <= reached  # the walk is read
    assert found == []


def _below(start: str, above: tuple) -> tuple:
    """``(reached, found)``: the client modules ``start`` reaches through its imports, never
    walking through one of ``above`` (names in client/), and each import of one of those."""
    graph = _import_graph()
    above = {f"expertd.client.{name}" for name in above}
    assert above <= set(graph)  # the names are the modules'
    reached, todo, found = set(), [start], []
    while todo:
        module = todo.pop()
        if module in reached:
            continue
        reached.add(module)
        for target in graph[module]:
            # The package itself (client/__init__.py, which loads the model) is not a floor.
            if not target.startswith("expertd.client."):
                continue
            if target in above:
                found.append(f"{module} imports {target}")
            else:
                todo.append(target)
    return reached, found


# What runs the step, and the front ends: above the step.
ABOVE_THE_STEP = ("decode", "batch", "loader", "runtime", "pipeline", "adapters", "serve",
                  "serve_http", "chat", "generate")


def test_the_step_imports_nothing_that_runs_it():
    """The step is a floor below the loops that run it and the loader that builds it (issue
    43): step.py and every client module it reaches import none of them."""
    reached, found = _below("expertd.client.step", ABOVE_THE_STEP)
    assert {f"expertd.client.{name}" for name in (
        "layer", "step_check", "speculation", "kvcache")} <= reached  # the walk is read
    assert found == []


def test_no_product_module_changes_an_objects_class():
    """Streamed switches and the guarded model are new modules installed in place (issue 25):
    no product code assigns ``__class__`` to a live object."""
    import ast

    graph = _import_graph()
    found = []
    trees = _parsed_product_files()
    for path, tree in trees.items():
        for node in ast.walk(tree):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                       else [])
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr == "__class__":
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "setattr" and len(node.args) > 1
                    and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value == "__class__"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert len(trees) >= len(graph) > 50  # every product module was read
    assert found == []


def test_an_error_naming_a_flag_is_a_flag_error():
    """The command line exits 2 for a flag's value found wrong late, by the exception's class
    (FlagError), not by its text: every error raised with a message that starts with a flag
    (a literal or an f-string) is one."""
    import ast

    found, flags = [], 0
    for path, tree in _parsed_product_files().items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                    and node.exc.args):
                continue
            first = node.exc.args[0]
            if isinstance(first, ast.JoinedStr) and first.values:
                first = first.values[0]
            if isinstance(first, ast.Constant) and str(first.value).startswith("--"):
                flags += 1
                name = getattr(node.exc.func, "id", getattr(node.exc.func, "attr", None))
                if name != "FlagError":
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} raises {name}")
    assert flags > 30  # the errors that name a flag were read
    assert found == []


def test_no_product_module_reads_another_modules_private_names():
    """Each part owns its state (issue 25): a name with a leading underscore that a product
    module defines (a function, a class, a module or instance attribute) is read or written
    through another object only inside that module. Libraries' own private names (argparse's,
    ``os._exit``) are not ours and not checked."""
    import ast

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    defined: dict = {}  # private name -> the modules defining it
    trees = _parsed_product_files()
    for path, tree in trees.items():
        for node in ast.walk(tree):
            names = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.append(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.append(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.append(node.attr)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.append(node.target.id)
            for name in filter(private, names):
                defined.setdefault(name, set()).add(path)
    found = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):  # from .other import _name
                for alias in node.names:
                    where = defined.get(alias.name, set())
                    if private(alias.name) and where and path not in where:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} {alias.name}")
                continue
            if not (isinstance(node, ast.Attribute) and private(node.attr)):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if (isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name)
                    and owner.func.id == "super"):
                continue
            where = defined.get(node.attr, set())
            if where and path not in where:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert len(defined) > 100  # the product's private names were collected
    assert found == []


def test_the_license_is_an_spdx_expression_in_the_built_metadata():
    """Issue 26 item 17: a license table (or a License classifier) made setuptools warn three
    times in ``make demo``; the expression form is what setuptools >= 77 writes as
    License-Expression (metadata 2.4), read here from the installed distribution."""
    import importlib.metadata

    meta = importlib.metadata.metadata("expertd")
    assert meta["License-Expression"] == "MIT"
    assert meta["License"] is None
    assert not [c for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]


def test_status_stop_and_start_import_no_mlx(models, isolated_env):
    """The commands that only talk to the daemon (start, status, stop) run with MLX and mlx-lm
    unimportable: they build their parsers without the client's compute modules."""
    import subprocess
    import sys

    blobs = models.blobs()
    script = ("import sys\n"
              "for name in ('mlx', 'mlx.core', 'mlx.nn', 'mlx_lm'):\n"
              "    sys.modules[name] = None  # import mlx raises ImportError\n"
              "from expertd.cli.main import main\n"
              "sys.argv = ['expertd'] + sys.argv[1:]\n"
              "main()\n")
    runs = [["start", "--blobs", str(blobs), "--cache-gb", "0.01"],
            ["status", "--blobs", str(blobs)], ["stop", "--blobs", str(blobs)]]
    try:
        for args in runs:
            done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True,
                                  text=True, timeout=120)
            assert done.returncode == 0, (args, done.stderr)
    finally:
        subprocess.run([sys.executable, "-m", "expertd", "stop", "--blobs", str(blobs)],
                       capture_output=True, timeout=120)
    assert "serving" in done.stdout or "stopped" in done.stdout
