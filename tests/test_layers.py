"""The layers of the code base: every import runs the right way, and the engine runs without Lightning.

``lightning_gpipe`` is five layers (docs/design.md, "Package map"): the engine (``lightning_gpipe/engine/``), the
profile (``profile/``), partitioning (``partition/``), the planner (``plan/``) and the Lightning layer (the modules at
the top). A module may import
its own layer and those below it. Outside the package: the library never imports the zoo, the benchmarks, the
launcher (``tools/``) or the tests; the zoo never imports the tests, the launcher or the benchmarks, and its modules
import each other without cycles; the benchmarks never import the tests; the launcher, which tests and benchmarks both
use, imports neither. Imports are read from the source with ``ast``, function-level ones included.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

from helpers.runif import RunIf

REPO = Path(__file__).resolve().parents[1]
SCANNED = ("lightning_gpipe", "zoo", "benchmarks", "tools")
LAYERS = ("engine", "profile", "partition", "planner", "lightning")  # bottom to top
LIGHTNING = ("lightning", "lightning_utilities", "torchmetrics")  # what only the Lightning layer may import
TESTS = ("tests", "helpers")  # tests/ is on the path of the test run, so its helpers import as `helpers`


def module_name(path: Path) -> str:
    """``lightning_gpipe/engine/stage.py`` -> ``lightning_gpipe.engine.stage``; a package is its ``__init__``."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for top in SCANNED for path in sorted((REPO / top).rglob("*.py"))}


def imports_of(source: str, module: str, is_package: bool = False, known: frozenset[str] = frozenset()) -> list[str]:
    """Every module that ``source`` (the code of ``module``) imports, at any depth of the code.

    ``from package import name`` counts as importing ``package.name`` when that is a module in ``known``.
    """
    package = module if is_package else module.rpartition(".")[0]
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            names = [f"{base}.{alias.name}" for alias in node.names]
            found += [name for name in names if name in known] or [base]
    return found


def layer_of(module: str) -> str | None:
    """The layer of a ``lightning_gpipe`` module, ``None`` outside the package."""
    parts = module.split(".")
    if parts[0] != "lightning_gpipe":
        return None
    if len(parts) > 1 and parts[1] in ("engine", "profile", "partition"):
        return parts[1]
    return "planner" if len(parts) > 1 and parts[1] == "plan" else "lightning"


def wrong_way(importer: str, imported: str) -> str | None:
    """Why ``importer`` must not import ``imported``, or ``None`` when the import runs the right way."""
    top, target_top = importer.split(".")[0], imported.split(".")[0]
    layer, target_layer = layer_of(importer), layer_of(imported)
    if layer is not None:
        if target_top in ("zoo", "benchmarks", "tools", *TESTS):
            return f"the library imports {target_top}"
        if target_top in LIGHTNING and layer != "lightning":
            return f"the {layer} layer imports {target_top}, which only the Lightning layer may"
        if target_layer is not None and LAYERS.index(target_layer) > LAYERS.index(layer):
            return f"the {layer} layer imports the {target_layer} layer above it"
    elif top == "zoo" and target_top in ("benchmarks", "tools", *TESTS):
        return f"the zoo imports {target_top}"
    elif top == "benchmarks" and target_top in TESTS:
        return "the benchmarks import the tests"
    elif top == "tools" and target_top in ("benchmarks", *TESTS):
        return f"the launcher imports {target_top}"
    return None


def graph() -> dict[str, list[str]]:
    """Each scanned module's imports."""
    known = frozenset(MODULES)
    return {
        module: imports_of(path.read_text(), module, path.name == "__init__.py", known)
        for module, path in MODULES.items()
    }


def cycles(edges: dict[str, list[str]]) -> list[list[str]]:
    """The import cycles among ``edges``' modules (Tarjan's strongly connected components of more than one)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in edges.get(node, []):
            if other not in edges:
                continue
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = stack[stack.index(node) :]
            del stack[stack.index(node) :]
            if len(component) > 1:
                found.append(sorted(component))

    for node in edges:
        if node not in index:
            visit(node)
    return found


def test_the_checker_reads_every_kind_of_import() -> None:
    # The rules below can only fail if the reader sees function-level, relative and from-imports.
    source = textwrap.dedent(
        """
        import lightning.pytorch as pl
        from . import stage
        from ..partition.sequence import find_sequence
        def later():
            from lightning_gpipe import strategy
        """
    )
    known = frozenset({"lightning_gpipe.engine.stage", "lightning_gpipe.strategy"})
    imported = imports_of(source, "lightning_gpipe.engine.step", known=known)
    assert imported == ["lightning.pytorch", "lightning_gpipe.engine.stage", "lightning_gpipe.partition.sequence",
                        "lightning_gpipe.strategy"]  # fmt: skip
    reasons = [wrong_way("lightning_gpipe.engine.step", name) for name in imported]
    assert reasons == [
        "the engine layer imports lightning, which only the Lightning layer may",
        None,
        "the engine layer imports the partition layer above it",
        "the engine layer imports the lightning layer above it",
    ]
    assert wrong_way("lightning_gpipe.partition.assembly", "torchmetrics") is not None
    assert wrong_way("lightning_gpipe.plan.auto", "lightning_gpipe.config") is not None
    assert wrong_way("lightning_gpipe.strategy", "lightning_gpipe.plan.auto") is None
    assert wrong_way("lightning_gpipe.plan", "zoo") == "the library imports zoo"
    assert wrong_way("zoo.cli", "lightning_gpipe") is None
    assert wrong_way("zoo.finetune", "helpers.models") == "the zoo imports helpers"
    assert wrong_way("benchmarks.bubble.run", "tests.helpers") == "the benchmarks import the tests"
    assert wrong_way("tools.launch", "benchmarks.machine") == "the launcher imports benchmarks"
    assert wrong_way("benchmarks.bubble.run", "tools.launch") is None
    assert wrong_way("lightning_gpipe.strategy", "tools.launch") == "the library imports tools"
    assert cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]


def test_every_layer_exists_and_holds_modules() -> None:
    held = {layer_of(module) for module in MODULES if module.startswith("lightning_gpipe")}
    assert held == set(LAYERS)
    assert {
        "lightning_gpipe.engine.stage",
        "lightning_gpipe.partition.assembly",
        "lightning_gpipe.plan.simulate",
    } <= set(MODULES)


def test_no_import_runs_the_wrong_way() -> None:
    wrong = [
        f"{module} imports {imported}: {reason}"
        for module, imported_modules in graph().items()
        for imported in imported_modules
        if (reason := wrong_way(module, imported)) is not None
    ]
    assert not wrong, "imports that run the wrong way:\n" + "\n".join(wrong)


def test_the_zoo_has_no_import_cycle() -> None:
    zoo = {module: imported for module, imported in graph().items() if module.split(".")[0] == "zoo"}
    assert not cycles(zoo), f"import cycles between zoo modules: {cycles(zoo)}"


ENGINE_ALONE = """
import sys

for name in ("lightning", "lightning_utilities", "torchmetrics"):
    sys.modules[name] = None  # importing it now raises ImportError

import torch
import torch.nn.functional as F
from torch import nn

from lightning_gpipe.engine import Pipeline, run_in_threads

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
x, y = torch.randn(8, 4), torch.randn(8, 2)
cells = [model[:2], model[2:]]
loss = run_in_threads(cells, (x, y), lambda out, mb: F.mse_loss(out, mb[1]), chunks=4, seeds=[0, 1])
pipelined = [p.grad.clone() for p in model.parameters()]
model.zero_grad()
expected = F.mse_loss(model(x), y)
expected.backward()
assert torch.allclose(loss, expected), (loss, expected)
assert all(torch.allclose(a, p.grad, atol=1e-6) for a, p in zip(pipelined, model.parameters()))
assert Pipeline.__module__ == "lightning_gpipe.engine.pipeline"
try:
    from lightning_gpipe import GPipeStrategy
except ImportError as error:
    assert "needs Lightning and torchmetrics" in str(error), error
else:
    raise AssertionError("GPipeStrategy imported without Lightning")
print("engine alone: ok")
"""


@RunIf(multiprocess=True)  # a fresh interpreter
def test_the_engine_trains_where_lightning_cannot_be_imported() -> None:
    # A fresh interpreter where lightning, lightning_utilities and torchmetrics raise ImportError.
    result = subprocess.run(
        [sys.executable, "-c", ENGINE_ALONE], cwd=REPO, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "engine alone: ok" in result.stdout
