"""Each built-in backend's facts live in its own module (serve/builtin/): its name, as a string anywhere in the
package's code (f-strings, concatenations and either quote included: an AST walk, docstrings apart), appears
only in that module and the registry. Its control: a planted name in another module is found."""

import ast
import re
from pathlib import Path

from pytest_kvoffload.serve.builtin import MODULES

PACKAGE = Path(__file__).resolve().parents[2] / "pytest_kvoffload"
REGISTRY = PACKAGE / "serve" / "builtin" / "__init__.py"
OWNERS = {module.NAME: Path(module.__file__) for module in MODULES}


def docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def names_in(text: str) -> list[tuple[int, str]]:
    """(line, backend name) for every built-in backend's name in a string constant of the source."""
    tree = ast.parse(text)
    skip = docstrings(tree)
    pattern = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, sorted(OWNERS, key=len, reverse=True)))
                         + r")(?![\w-])")
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            hits += [(node.lineno, m.group(1)) for m in pattern.finditer(node.value)]
    return hits


def misplaced(paths) -> list[str]:
    found = []
    for path in paths:
        for line, name in names_in(path.read_text()):
            if path != OWNERS[name] and path != REGISTRY:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line} names {name}")
    return found


def test_each_backend_name_lives_in_its_own_module_and_the_registry():
    assert len(OWNERS) == 6
    assert not misplaced(sorted(PACKAGE.rglob("*.py"))), "\n".join(misplaced(sorted(PACKAGE.rglob("*.py"))))


def test_a_planted_name_is_found_in_an_f_string_and_a_concatenation(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('"""gpu-only in a docstring is prose."""\nx = 1\n'
                       'a = f"{x} kvoffload-disk[slow]"\nb = \'native-\' "disk"\nc = "lmcache-disk speed"\n')
    assert sorted(names_in(planted.read_text())) == [(3, "kvoffload-disk"), (4, "native-disk"), (5, "lmcache-disk")]
    assert not names_in('y = "kvoffload-disky"\nz = "lmcache-inproc-disk-x"\n')
