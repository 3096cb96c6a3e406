"""The package's architecture, checked (docs/layout.md): the import-linter contract in pyproject.toml holds,
and a planted upward import breaks it (its control); no import cycle between modules; no module over 400
lines, no function over 80, no suite file of 100 lines or more; tests/ mirrors the package's folders."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pytest_kvoffload"
LINT = Path(sys.executable).with_name("lint-imports")
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_SUITE_LINES = 400, 80, 100


def lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--config", str(root / "pyproject.toml"), "--no-cache"], cwd=root,
                          capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(root), "PATH": ""})


@pytest.fixture(scope="module")
def copy(tmp_path_factory):
    """The package and its contract, copied: the control plants its import there, never in the checkout."""
    root = tmp_path_factory.mktemp("layers")
    shutil.copytree(PACKAGE, root / "pytest_kvoffload", ignore=shutil.ignore_patterns("__pycache__", "model_configs"))
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


def test_the_layer_contract_holds(copy):
    done = lint(copy)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]
    assert "0 broken" in done.stdout


@pytest.mark.parametrize("module, planted", [
    # The connector (inside vLLM) reaching the harness, inside a function: imports there count too.
    ("connector/index.py", "def _planted():\n    from pytest_kvoffload.harness import session  # noqa\n"),
    # The record layer reaching serving.
    ("record/report.py", "from pytest_kvoffload.serve import client  # noqa\n"),
    # The bottom layer reaching up.
    ("core/costs.py", "import pytest_kvoffload.measure.cells  # noqa\n"),
    # The analysis layer reaching the measuring code above it, and the test-only connector the serving side.
    ("analysis/fits.py", "from pytest_kvoffload.measure import cells  # noqa\n"),
    ("rigged/knobs.py", "from pytest_kvoffload.serve import backend  # noqa\n"),
])
def test_a_planted_upward_import_breaks_the_contract(copy, module, planted):
    path = copy / "pytest_kvoffload" / module
    original = path.read_text()
    try:
        path.write_text(original + "\n\n" + planted)
        done = lint(copy)
    finally:
        path.write_text(original)
    assert done.returncode != 0 and "BROKEN" in done.stdout, done.stdout[-2000:]
    assert module.replace("/", ".").removesuffix(".py") in done.stdout


def imports_of(path: Path) -> set[str]:
    """The package modules `path` imports (anywhere in it, functions included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pytest_kvoffload"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("pytest_kvoffload"))
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_cycle_between_modules():
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: {i for i in imports_of(p) if i in modules and i != m} for m, p in modules.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(m, stack):
        state[m] = 1
        for n in graph[m]:
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles[:5])


def test_a_planted_cycle_is_found(tmp_path, monkeypatch):
    """The cycle check's control: two modules importing each other."""
    pkg = tmp_path / "pytest_kvoffload"
    pkg.mkdir()
    (pkg / "a.py").write_text("from pytest_kvoffload import b\n")
    (pkg / "b.py").write_text("def f():\n    from pytest_kvoffload.a import x\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError, match="pytest_kvoffload.a -> pytest_kvoffload.b -> pytest_kvoffload.a"):
        test_no_import_cycle_between_modules()


def test_modules_functions_and_suites_stay_small():
    too_long = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    for path in (ROOT / "suites").glob("*.py"):
        if path.read_text().count("\n") >= MAX_SUITE_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: a suite of {path.read_text().count(chr(10))} lines")
    assert not too_long, "; ".join(too_long)


def test_tests_mirror_the_package():
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    test_folders = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and p.name not in ("fixtures", "__pycache__")}
    assert test_folders <= folders, f"test folders with no package folder: {sorted(test_folders - folders)}"
    untested = sorted(f for f in folders - test_folders)
    assert not untested, f"package folders without tests/<folder>/: {untested}"


def test_the_layout_answers_each_where_question_with_one_existing_module():
    """docs/layout.md's "Where is it?" table: each of its questions has one path first, and that module exists."""
    text = (ROOT / "docs" / "layout.md").read_text()
    table = text[text.index("## Where is it?"):text.index("## Which way imports run")]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| question")]
    assert len(rows) == 6
    for row in rows:
        first = row.split("|")[2].split("`")[1]
        assert (PACKAGE / first).is_file(), f"{first} (docs/layout.md) is no module of the package"


def test_no_two_modules_share_a_file_name():
    """One name, one module: `check.py` twice is two guesses for a reader (package `__init__.py` apart)."""
    seen: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py":
            seen.setdefault(path.name, []).append(str(path.relative_to(PACKAGE)))
    assert not {n: p for n, p in seen.items() if len(p) > 1}
