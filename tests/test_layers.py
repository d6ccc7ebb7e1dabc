"""Imports flow one way: cli -> harness -> worker -> strategies -> core (the loop, its tools, config, dist,
devices, workloads). Read from the source, every import counted, at module level or inside a function:
an import hidden in a function ties two modules together all the same."""

import ast
from pathlib import Path

from tests.conftest import ROOT

PACKAGE = ROOT / "parallel"
# Each module (or sub-package) and its layer; a module may import its own layer or any lower one.
LAYERS = {
    "cli": 5, "__main__": 5, "sweep": 5, "preflight": 5, "basics": 5, "envinfo": 5,
    "harness": 4,
    "worker": 3, "plan": 3,
    "strategies": 2,
    "train": 1, "timing": 1, "profiling": 1, "checkpoint": 1, "results": 1, "activations": 1, "formulas": 1,
    "tables": 1,
    "config": 0, "dist": 0, "devices": 0, "workloads": 0, "data": 0, "transformer": 0, "tpplan": 0, "moe": 0,
    "errors": 0, "layout": 0, "usermodel": 0, "hf": 0, "outputs": 0,
}


def room(module: str) -> str:
    """parallel.harness.runner -> harness; parallel.train -> train."""
    return module.split(".")[1] if module.count(".") else "parallel"


def imports() -> set[tuple[str, str, str]]:
    """(importing module, imported module, where) for every import of a parallel module."""
    found = set()
    for f in PACKAGE.rglob("*.py"):
        rel = f.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        package = rel.parts[:-1]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                if t.startswith("parallel.") and (ROOT / Path(*t.split("."))).with_suffix(".py").exists() or \
                        t.startswith("parallel.") and (ROOT / Path(*t.split("."))).is_dir():
                    found.add((name, t, f"{f.relative_to(ROOT)}:{node.lineno}"))
    return found


def test_every_module_has_a_layer():
    rooms = {room(m) for m, _, _ in imports()} | {room(t) for _, t, _ in imports()}
    assert rooms - {"parallel"} <= LAYERS.keys(), sorted(rooms - LAYERS.keys())


def test_the_scan_sees_imports_at_module_level_and_inside_functions():
    found = {(m, t) for m, t, _ in imports()}
    assert ("parallel.worker", "parallel.strategies") in found  # module level
    assert ("parallel.cli", "parallel.harness.runner") in found  # inside a function


def test_imports_flow_one_way():
    upward = sorted(f"{where}: {m} imports {t}" for m, t, where in imports()
                    if room(m) != room(t) and LAYERS[room(t)] > LAYERS[room(m)])
    assert upward == [], "\n".join(upward)


def test_no_two_rooms_import_each_other_even_within_a_layer():
    edges: dict[str, set[str]] = {}
    for m, t, _ in imports():
        if room(m) != room(t):
            edges.setdefault(room(m), set()).add(room(t))

    def reaches(a: str, b: str, seen: set[str]) -> bool:
        return any(n == b or (n not in seen and reaches(n, b, seen | {n})) for n in edges.get(a, ()))

    cycles = sorted(f"{a} <-> {b}" for a, targets in edges.items() for b in targets if reaches(b, a, {b}))
    assert cycles == [], cycles
