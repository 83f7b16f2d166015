"""jlong's packages and top-level modules import one way: each may import
only those before it in LAYERS (lazy imports inside functions included;
imports under `if TYPE_CHECKING:` are not imports at run time and are
allowed). A new package or top-level module must be placed here."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast  # every test here is quick: the fast tier (pytest -m fast)

PACKAGE = Path(__file__).resolve().parents[1] / "jlong"

# Lowest first: shared names and hardware-free helpers (the record of which
# kernels have run on a GPU among them), the config (plain data: it asks the
# families and attention's methods what they need through what they register
# with it), the maths that attention and the model share, attention, the model
# families (each an architecture: its layout, blocks, Hugging Face form), every
# built-in part registered (components), the model, its placement on a mesh,
# the sampler that runs the placed model, weights in and out (with the digests
# that name them and the initial weights read from them), data, the training
# objectives, the program, then what runs the program (planner, evaluator,
# generation's records, loop), then the ways in (Python API, command line),
# and above them the documentation's generated reference pages.
LAYERS = [
    "errors", "options", "files", "plots", "jax_private", "jax_startup", "kernel_runs",
    "config",
    "ops",
    "linear_attention", "moe",
    "attention",
    "families", "lora",
    "components", "hf_config",
    "model",
    "parallel",
    "generation",
    "hf", "checkpoint_integrity", "digests", "checkpoint", "init_from",
    "data",
    "objectives",
    "program",
    "planner", "eval", "completions",
    "training",
    "api",
    "cli", "__main__",
    "docgen",
]


def _unit(path: Path) -> str:
    """The layer unit of a file: its package under jlong/, or its module's name."""
    first = path.relative_to(PACKAGE).parts[0]
    return first.removesuffix(".py")


def _imported_units(tree: ast.AST, path: Path) -> set[tuple[str, int]]:
    """(unit, line) of every jlong import in the file, outside `if TYPE_CHECKING:` blocks."""
    type_checking = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                     and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_checking:
            continue
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against the file's package
                base = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-node.level]
                modules = [".".join([*base, node.module] if node.module else base)]
            else:
                modules = [node.module or ""]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[0] == "jlong" and len(parts) > 1:
                found.add((parts[1], node.lineno))
    return found


def _files():
    return sorted(PACKAGE.rglob("*.py"))


def test_every_package_and_top_level_module_has_a_layer():
    units = {_unit(path) for path in _files()} - {"__init__"}
    assert sorted(units - set(LAYERS)) == [], "place these in LAYERS"
    assert sorted(set(LAYERS) - units) == [], "LAYERS names units that no longer exist"


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_go_down_the_layers(path):
    unit = _unit(path)
    if unit == "__init__":  # the package root loads the public names lazily, on first use
        return
    level = LAYERS.index(unit)
    tree = ast.parse(path.read_text())
    upward = sorted(f"line {line}: jlong.{target}" for target, line in _imported_units(tree, path)
                    if target in LAYERS and LAYERS.index(target) > level)
    assert upward == [], f"jlong.{unit} imports layers above it"
