"""Imports flow one way, between the package's folders and inside them: each folder is one layer, and a
module may import its own layer or any lower one (LAYERS, lowest last; DESIGN.md's table says the same).

Read from the source, every import counted, at module level or inside a function: an import hidden in a
function ties two modules together all the same. Inside a folder, no module may reach itself through
others either: the module graph of the whole package has no circle."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

PACKAGE = ROOT / "parallel"
# One line per folder (and per module at the top, where a reader enters), from the commands down.
LAYERS = {
    "cli": 10, "cliargs": 10, "__main__": 10, "script": 10, "sweep": 10, "preflight": 10, "envinfo": 10,  # commands
    "basics": 10,  # the GPU basics (bench)
    "compare": 9, "tools": 9,  # every strategy in its own child, judged and reported; standalone timing tools
    "report": 8,  # the terminal screen, details.txt, report.html, notes, verdict, cost model: one door, write()
    "judge": 7,  # the oracle against single, honest noise, injected bugs, the shallow twin, hangs named
    "worker": 6, "plan": 6,  # one strategy's run in one process; the planner
    "strategies": 5, "config": 5,  # only strategies and the interface they share (base); the run's options
    "measure": 4,  # one home per measurement family: what is measured, predicted, shown; never a strategy
    "kit": 3, "launch": 3,  # blocks strategies share (collectives by hand, stages, schedules); child processes
    "loop": 2, "style": 2,  # THE loop and its tools (timing, wire, recorder, faults, checkpoint), the row; the look
    "models": 1,  # workloads, built-in models, data, Hugging Face decoders, a user's model and data
    "world": 0,  # devices, the --devices grammar, machine, dist, the parallel dims, the one error type
}
TOP = 12  # modules at the top of parallel/, at most
PER_FOLDER = 15  # files in one folder, at most


def room(module: str) -> str:
    """parallel.compare -> harness; parallel.loop.train -> train."""
    return module.split(".")[1] if module.count(".") else "parallel"


def _module(name: str) -> bool:
    path = ROOT / Path(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports() -> set[tuple[str, str, str]]:
    """(importing module, imported module, where) for every import of a parallel module: `from a.b import c`
    names a.b.c where c is a module, else a.b."""
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
                targets = [f"{base}.{a.name}" if _module(f"{base}.{a.name}") else base for a in node.names]
            else:
                continue
            for t in targets:
                if t.startswith("parallel.") and _module(t):
                    found.add((name, t, f"{f.relative_to(ROOT)}:{node.lineno}"))
    return found


def test_every_module_has_a_layer():
    rooms = {room(m) for m, _, _ in imports()} | {room(t) for _, t, _ in imports()}
    assert rooms - {"parallel"} <= LAYERS.keys(), sorted(rooms - LAYERS.keys())


def test_the_scan_sees_imports_at_module_level_and_inside_functions():
    found = {(m, t) for m, t, _ in imports()}
    assert ("parallel.worker", "parallel.strategies") in found  # module level
    assert ("parallel.cli", "parallel.compare") in found  # inside a function
    assert ("parallel.measure.replay", "parallel.kit.schedules") in found  # inside a folder


def test_imports_flow_one_way():
    upward = sorted(f"{where}: {m} imports {t}" for m, t, where in imports()
                    if room(m) != room(t) and LAYERS[room(t)] > LAYERS[room(m)])
    assert upward == [], "\n".join(upward)


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one node (Tarjan's algorithm): each is a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def test_no_circle_among_modules_even_inside_a_folder():
    edges: dict[str, set[str]] = {}
    for m, t, _ in imports():
        if m != t:
            edges.setdefault(m, set()).add(t)
    assert circles(edges) == []


def test_no_two_rooms_import_each_other_even_within_a_layer():
    edges: dict[str, set[str]] = {}
    for m, t, _ in imports():
        if room(m) != room(t):
            edges.setdefault(room(m), set()).add(room(t))
    assert [c for c in circles(edges)] == []


def test_the_circle_finder_finds_a_planted_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_strategies_holds_only_strategies_each_in_its_folder():
    from parallel.strategies import MODULES, NAMES

    files = {".".join(f.relative_to(ROOT).with_suffix("").parts): f.stem
             for f in (PACKAGE / "strategies").rglob("*.py") if f.stem not in ("base", "__init__")}
    assert sorted(files.values()) == sorted(NAMES)
    assert {files[m]: m for m in files} == MODULES


def test_the_top_says_where_to_enter_and_no_folder_is_crowded():
    top = sorted(f.stem for f in PACKAGE.glob("*.py"))
    assert len(top) <= TOP, top
    crowded = {str(d.relative_to(ROOT)): n for d in PACKAGE.rglob("*") if d.is_dir() and d.name != "__pycache__"
               and (n := len([f for f in d.iterdir() if f.is_file()])) > PER_FOLDER}
    assert crowded == {}


LESSON = ("setup", "train_step", "Options", "MUTANTS", "HOOKS")  # the order a strategy's file reads in


def lesson_order(source: str) -> list[str]:
    """The names of LESSON a module defines at its top level, in the order it defines them."""
    names = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
    return [n for n in names if n in LESSON]


def test_every_strategy_opens_on_its_algorithm():
    """Docstring, identity, then setup and train_step; the Options and checks after them; the injected bugs
    and the hooks last (DESIGN.md, "How to add")."""
    for f in sorted((PACKAGE / "strategies").rglob("*.py")):
        if f.stem in ("base", "__init__"):
            continue
        order = lesson_order(f.read_text())
        assert order == [n for n in LESSON if n in order], (f.name, order)
        setup = next(i for i, line in enumerate(f.read_text().splitlines(), 1) if line.startswith("def setup("))
        assert setup <= 60, (f.name, setup)  # past the docstring and the imports only


def test_the_lesson_rule_sees_a_file_that_opens_on_its_options():
    source = "class Options: pass\nMUTANTS = ()\ndef setup(): pass\ndef train_step(): pass\nHOOKS = None\n"
    assert lesson_order(source) != [n for n in LESSON if n in lesson_order(source)]


def test_no_package_file_is_over_300_lines():
    long = {str(f.relative_to(ROOT)): n for f in PACKAGE.rglob("*.py") if (n := len(f.read_text().splitlines())) > 300}
    assert long == {}


COUNTS_ITS_OWN = re.compile(r"wire\.Counter\(|\bcounter\.step\(\)|wire\.moved\(|comm_bytes \+=|\.comm_bytes = ")


def test_no_strategy_counts_its_own_bytes():
    """The loop counts the bytes around every step (train.py, wire.Counter); the building blocks report the
    copies they make (wire.moved). A strategy that counted its own would count twice, or alone."""
    found = [f"{f.name}:{i}: {line.strip()}" for f in (PACKAGE / "strategies").rglob("*.py")
             for i, line in enumerate(f.read_text().splitlines(), 1) if COUNTS_ITS_OWN.search(line)]
    assert found == []


def test_the_byte_rule_sees_a_strategy_that_counts():
    assert COUNTS_ITS_OWN.search("    with t.state.counter.step():") and COUNTS_ITS_OWN.search("t.comm_bytes += n")


DERIVES = re.compile(r"\b(options_of|workload_of|shape_model)\(")


def test_options_and_workload_are_derived_once_and_handed_down():
    """A strategy's typed options, the workload and the meta model reach strategies, kit and measure as a
    Run (strategies/base.py): the one place that derives them from the config."""
    found = [f"{f.relative_to(ROOT)}:{i}" for room in ("strategies", "kit", "measure")
             for f in (PACKAGE / room).rglob("*.py")
             for i, line in enumerate(f.read_text().splitlines(), 1)
             if DERIVES.search(line.split("#")[0]) and not line.lstrip().startswith("def ")]
    assert found == ["parallel/strategies/base.py:32", "parallel/strategies/base.py:33",
                     "parallel/strategies/base.py:42"], found


def test_the_hand_down_rule_sees_a_strategy_that_derives_its_own():
    assert DERIVES.search("    o = options_of(Options, config)") and DERIVES.search("w = workload_of(config).x")


def test_no_package_module_reaches_outside_the_package():
    """An installed package has no scripts/, examples/ or tests/ beside it: nothing in it climbs out of it."""
    climbs = re.compile(r"parents\[\d\]|\.parent\.parent|\"(scripts|examples|tests)\" /")
    found = [f"{f.relative_to(ROOT)}:{i}" for f in PACKAGE.rglob("*.py")
             for i, line in enumerate(f.read_text().splitlines(), 1) if climbs.search(line.split("#")[0])]
    assert found == []


@pytest.mark.slow
def test_the_entry_points_import_no_dtensor_and_no_checkpointing():
    """DTensor and DCP cost a process 0.7-0.8 s and 0.5 s of start-up (python -X importtime): imported where
    they are met (world/dist.is_dtensor), never by the commands' imports; #72's Muon and masters once put
    DTensor back into every process."""
    code = ("import sys, parallel.cli, parallel.worker, parallel.compare; print(sorted(m for m in "
            "('torch.distributed.tensor', 'torch.distributed.checkpoint') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]
