"""hfl3's imports point down the layers docs/design.md (Layers) draws: every `import hfl3...` in `src/hfl3`, lazy ones
inside functions included, goes from a layer to one below it (or, where the table allows, to the same layer), and
no package imports itself back through another. A module that imports upward is one a reader cannot understand
without what sits above it, and the model, the optimizer and FP8 must load without the rest of hfl3."""

import ast
import collections
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "hfl3"

# (layer, its units, whether units of the layer may import each other), bottom first. A unit is a top-level module
# or package of hfl3 (`__init__` is the package's own module). Keep in step with docs/design.md, Layers.
LAYERS = [
    ("leaves", {"atomic", "errors", "distributed", "provenance"}, True),
    ("model", {"models"}, False),
    ("parts", {"optim", "fp8", "data", "tokenization", "generation", "evaluate", "serve"}, False),
    ("trainer layer", {"trainers", "callbacks", "nanochat"}, True),
    ("package", {"__init__"}, False),
]
SELF_CONTAINED = {"models", "optim", "fp8"}
"""Units that import nothing else of hfl3: the model ships as remote code; the optimizer and FP8 serve any module."""


def unit_of(path: Path) -> str:
    return path.relative_to(SRC).with_suffix("").parts[0]


def imported_units(path: Path) -> set[str]:
    """The hfl3 units `path` imports, anywhere in the file (module level or inside a function)."""
    package = path.relative_to(SRC.parent).with_suffix("").parts[:-1]
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else ()
            module = ".".join((*base, *([node.module] if node.module else [])))
            names += [module] if node.module or not node.level else [f"{module}.{a.name}" for a in node.names]
    return {name.split(".")[1] for name in names if name.startswith("hfl3.") and name.count(".") >= 1}


def import_graph() -> dict[str, set[str]]:
    graph = collections.defaultdict(set)
    for path in SRC.rglob("*.py"):
        graph[unit_of(path)] |= imported_units(path) - {unit_of(path)}
    return graph


def problems(graph: dict[str, set[str]]) -> list[str]:
    """What in `graph` breaks the layers: an unknown unit, an import upward or across a layer that forbids it, an
    import by a self-contained unit, and any cycle between units."""
    layer_of = {unit: (index, name, across) for index, (name, units, across) in enumerate(LAYERS) for unit in units}
    found = [f"{unit}: in no layer of LAYERS" for unit in sorted(set(graph) | set().union(*graph.values()))
             if unit not in layer_of]
    for unit, targets in sorted(graph.items()):
        for target in sorted(targets):
            if unit not in layer_of or target not in layer_of:
                continue
            (low, name, across), (high, target_name, _) = layer_of[unit], layer_of[target]
            if unit in SELF_CONTAINED:
                found.append(f"{unit} imports hfl3.{target}: it must import nothing else of hfl3")
            elif high > low or (high == low and not across):
                found.append(f"{unit} ({name}) imports hfl3.{target} ({target_name}): upward or across the layer")
    seen, stack = set(), []

    def visit(unit: str) -> None:
        if unit in stack:
            found.append("cycle: " + " -> ".join(stack[stack.index(unit):] + [unit]))
            return
        if unit in seen:
            return
        seen.add(unit)
        stack.append(unit)
        for target in sorted(graph.get(unit, ())):
            visit(target)
        stack.pop()

    for unit in sorted(graph):
        visit(unit)
    return found


def test_imports_point_down_the_layers():
    graph = import_graph()
    assert {"trainers", "data", "models"} <= set(graph)  # the walk found the package
    assert not problems(graph), "hfl3 imports against its layers (docs/design.md, Layers):\n" + "\n".join(
        problems(graph))


def test_the_check_tells_a_wrong_import_apart():
    assert problems({"models": {"atomic"}, "data": {"trainers", "evaluate"}, "atomic": {"distributed"},
                     "distributed": {"atomic"}, "nowhere": set()}) == [
        "nowhere: in no layer of LAYERS",
        "data (parts) imports hfl3.evaluate (parts): upward or across the layer",
        "data (parts) imports hfl3.trainers (trainer layer): upward or across the layer",
        "models imports hfl3.atomic: it must import nothing else of hfl3",
        "cycle: atomic -> distributed -> atomic",
    ]
