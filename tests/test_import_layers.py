"""The config stays the bottom layer: no module under jlong/config imports a
family, a sequence-parallel method, a kernel or linear attention (type-only
and function-local imports counted), and no circle of imports runs through
it. Read from the sources with ast; nothing is imported."""

import ast

import pytest
from helpers import REPO

pytestmark = pytest.mark.fast

PACKAGE = REPO / "jlong"
ABOVE_CONFIG = ("jlong.families", "jlong.attention", "jlong.linear_attention", "jlong.moe")


def _module_name(path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _imported(module: str) -> set[str]:
    """The jlong modules `module` imports anywhere in its source (under TYPE_CHECKING and in functions too)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).rstrip(".")
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:  # `import jlong.a.b` names jlong.a.b; a name in it, its module
                name = name.rpartition(".")[0]
            if name.startswith("jlong"):
                found.add(name)
    return found - {module}


def test_no_config_module_imports_the_layers_above_it():
    config_modules = [m for m in MODULES if m == "jlong.config" or m.startswith("jlong.config.")]
    assert len(config_modules) >= 5
    wrong = {m: sorted(i for i in _imported(m) if i.startswith(ABOVE_CONFIG)) for m in config_modules}
    assert {m: i for m, i in wrong.items() if i} == {}


def test_no_circle_of_imports_runs_through_config():
    graph = {m: _imported(m) for m in MODULES}
    for start in [m for m in graph if m.startswith("jlong.config")]:
        # every module `start` reaches; a circle through it is one that reaches back
        seen, todo = set(), list(graph[start])
        while todo:
            module = todo.pop()
            if module not in seen:
                seen.add(module)
                todo.extend(graph[module])
        assert start not in seen, f"{start} imports itself back through {sorted(seen)}"


def test_the_circle_check_finds_a_circle():
    assert "jlong.config.registry" in _imported("jlong.families.registry")  # the families register with the config
    assert "jlong.config.schema" in _imported("jlong.config.loading")
