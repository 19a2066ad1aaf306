"""The imports of ``fluxcompile/`` and ``benchmarks/``, read with ``ast`` (module-level and function-level imports,
relative ones resolved), against the package's layering: no import cycle; no import from a lower layer into a
higher one (``config``, ``ops`` < ``symm_mem/`` < ``kernels/``, ``schedules/`` < ``lowerings/`` < ``fx_passes/`` <
``backend``); no import between two op folders (``lowerings/<op>/``); no import of another module's private name;
no import of ``fluxcompile.testing`` by the product. Then the one-definition rules of the runtime half: one
communication context class and one ``comm_for`` (in ``symm_mem/``), at most one tile ``Variant`` per kernel family
file and none outside ``kernels/``, and one CUDA event timer in ``benchmarks/`` (``timing.py``).

An import names the module it reaches: ``from pkg import name`` reaches ``pkg.name`` where that is a module, else
``pkg`` itself (its ``__init__``), so a cycle through a package's ``__init__`` counts; a package's ``__init__``
importing its own modules is no cycle by itself. For cycles, importing ``a.b.c`` also runs the ``__init__`` of
``a.b`` (unless the importer lies inside ``a.b``, which is then already being imported).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fluxcompile"
BENCHMARKS = ROOT / "benchmarks"

# Layers, low to high: a module may import its own layer and lower ones. schedules/ sits beside kernels/.
LAYERS = {
    "fluxcompile.config": 0,
    "fluxcompile.ops": 0,
    "fluxcompile.version": 0,
    "fluxcompile.symm_mem": 1,
    "fluxcompile.kernels": 2,
    "fluxcompile.schedules": 2,
    "fluxcompile.lowerings": 3,
    "fluxcompile.fx_passes": 4,
    "fluxcompile.backend": 5,
}
LOWERINGS = "fluxcompile.lowerings"
TESTING = "fluxcompile.testing"
# Modules of the package that may import testing/: the demo (python -m fluxcompile demo) runs gloo ranks and checks
# numerics with testing/'s rank pool and error measures, as the tests do; it is a client of the package that
# nothing of the compile path imports, so it is no product module that would pull testing/ into a compile.
TESTING_CLIENTS = ("fluxcompile.demo",)


@dataclasses.dataclass(frozen=True)
class Module:
    name: str  # dotted: fluxcompile.symm_mem.comm, fluxcompile.symm_mem (its __init__), benchmarks.ops
    path: Path
    is_package: bool

    @functools.cached_property
    def tree(self) -> ast.Module:
        return ast.parse(self.path.read_text(), str(self.path))

    @property
    def where(self) -> str:
        return str(self.path.relative_to(ROOT))


@dataclasses.dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int
    runtime: bool  # False under ``if TYPE_CHECKING:``

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} (line {self.line})"


def package_modules() -> dict[str, Module]:
    mods = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        mods[".".join(parts)] = Module(".".join(parts), path, is_package)
    return mods


def benchmark_modules() -> dict[str, Module]:
    """The benchmarks are scripts run from benchmarks/, which import each other by bare name (``import timing``)."""
    return {f"benchmarks.{p.stem}": Module(f"benchmarks.{p.stem}", p, False) for p in sorted(BENCHMARKS.glob("*.py"))}


@functools.cache
def all_modules() -> dict[str, Module]:
    return {**package_modules(), **benchmark_modules()}


def _known(dotted: str, source: Module) -> str | None:
    """The module of ours that an absolute dotted name reaches: itself or its longest known prefix (``None``: not
    ours). The benchmarks' bare names are theirs only from another benchmark."""
    mods = all_modules()
    if source.name.startswith("benchmarks.") and f"benchmarks.{dotted.split('.')[0]}" in mods:
        return f"benchmarks.{dotted.split('.')[0]}"
    if not _in(dotted, "fluxcompile"):
        return None
    parts = dotted.split(".")
    while parts:
        if ".".join(parts) in mods:
            return ".".join(parts)
        parts.pop()
    return None


def _base(source: Module, node: ast.ImportFrom) -> str:
    """The absolute module named by an ``from ... import``'s module part, relative levels resolved."""
    if not node.level:
        return node.module or ""
    package = source.name.split(".") if source.is_package else source.name.split(".")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def _walk(tree: ast.AST) -> Iterator[tuple[ast.AST, bool]]:
    """Every node with whether it runs (False under ``if TYPE_CHECKING:``)."""
    todo: list[tuple[ast.AST, bool]] = [(tree, True)]
    while todo:
        node, runtime = todo.pop()
        yield node, runtime
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += [(n, False) for n in node.body] + [(n, runtime) for n in node.orelse]
        else:
            todo += [(n, runtime) for n in ast.iter_child_nodes(node)]


def imports_of(module: Module) -> list[Import]:
    found = []
    mods = all_modules()
    for node, runtime in _walk(module.tree):
        targets: list[str | None] = []
        if isinstance(node, ast.Import):
            targets = [_known(a.name, module) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, node)
            for a in node.names:
                sub = f"{base}.{a.name}"
                targets.append(sub if sub in mods else _known(base, module) if base else None)
        found += [Import(module.name, t, node.lineno, runtime) for t in targets if t and t != module.name]
    return found


@functools.cache
def import_graph() -> tuple[Import, ...]:
    return tuple(sorted({i for m in all_modules().values() for i in imports_of(m)}, key=str))


def runs(i: Import) -> list[str]:
    """The modules an import runs: its target and the packages above it that the importer is not inside (those
    are being imported already)."""
    parts, mods = i.target.split("."), all_modules()
    above = [".".join(parts[:k]) for k in range(1, len(parts))]
    return [i.target] + [p for p in above if p in mods and not _in(i.source, p)]


def cycles(prefix: str) -> list[list[str]]:
    """The import cycles among the modules whose names start with ``prefix`` (running imports): the strongly
    connected components of more than one module (Tarjan), each sorted."""
    edges: dict[str, set[str]] = {}
    for i in import_graph():
        if i.runtime and i.source.startswith(prefix):
            edges.setdefault(i.source, set()).update(t for t in runs(i) if t.startswith(prefix))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def _shortest_cycle(members: set[str]) -> list[str]:
    """One shortest cycle among ``members``, as modules with the import line between each two."""
    steps: dict[str, list[tuple[str, str]]] = {}  # module -> (module it runs, "line n") within the members
    for i in import_graph():
        if i.runtime and i.source in members:
            for t in runs(i):
                if t in members:
                    steps.setdefault(i.source, []).append((t, f"(line {i.line})"))
    best: list[str] = []
    for start in sorted(members):  # breadth first from each member: its first way back is its shortest
        paths, frontier, found = {start: [start]}, [start], None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for t, line in steps.get(v, []):
                    if t == start and found is None:
                        found = [*paths[v], line, t]
                    elif t not in paths:
                        paths[t] = [*paths[v], line, t]
                        nxt.append(t)
            frontier = nxt
        if found and (not best or len(found) < len(best)):
            best = found
    return best


def _cycle_report(components: list[list[str]]) -> str:
    return "\n".join(
        f"cycle of {len(comp)} modules: {', '.join(comp)}\n    e.g. {' '.join(_shortest_cycle(set(comp)))}"
        for comp in components
    )


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def layer_of(name: str) -> int | None:
    return next((rank for top, rank in LAYERS.items() if _in(name, top)), None)


def op_folder(name: str) -> str | None:
    """The op folder (a subpackage of lowerings/) that holds a module, if any."""
    mods = all_modules()
    if not _in(name, LOWERINGS) or name == LOWERINGS:
        return None
    top = ".".join(name.split(".")[:3])
    return top if mods[top].is_package else None


def private_name_uses(module: Module) -> list[str]:
    """``from x import _y`` and ``x._y`` (``x`` a name an import bound to a module) where ``x`` is another module
    of ours; dunder names are not private."""
    mods = all_modules()

    def private(name: str) -> bool:
        return name.startswith("_") and not name.endswith("__")

    uses, bound = [], {}
    for node, _ in _walk(module.tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                target = _known(a.name, module)
                if target is None:
                    continue
                if a.asname:
                    bound[a.asname] = target if target == a.name or target.startswith("benchmarks.") else None
                else:
                    top = a.name.split(".")[0]
                    bound[top] = _known(top, module)
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, node)
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in mods:
                    bound[a.asname or a.name] = sub
                elif private(a.name) and _known(base, module) not in (None, module.name):
                    uses.append(f"{module.where}:{node.lineno}: from {base} import {a.name}")
    for node, _ in _walk(module.tree):
        if not (isinstance(node, ast.Attribute) and private(node.attr)):
            continue
        chain, value = [node.attr], node.value
        while isinstance(value, ast.Attribute):
            chain.insert(0, value.attr)
            value = value.value
        if not isinstance(value, ast.Name) or bound.get(value.id) is None:
            continue
        owner = bound[value.id]
        for attr in chain[:-1]:
            if f"{owner}.{attr}" not in mods:
                break
            owner = f"{owner}.{attr}"
        else:
            if owner != module.name:
                uses.append(f"{module.where}:{node.lineno}: {ast.unparse(node)} (private name of {owner})")
    return uses


def definitions(test, prefix: str = "fluxcompile") -> list[tuple[Module, ast.AST]]:
    """Every class or function definition (any depth) of the modules under ``prefix`` that ``test`` accepts."""
    return [
        (m, node)
        for m in all_modules().values()
        if _in(m.name, prefix)
        for node, _ in _walk(m.tree)
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and test(node)
    ]


def _places(defs: list[tuple[Module, ast.AST]]) -> str:
    return ", ".join(f"{m.where}:{node.lineno} {node.name}" for m, node in defs) or "none"


# --- the rules ---


def test_the_modules_are_found():
    mods = all_modules()
    assert {"fluxcompile", "fluxcompile.backend", "fluxcompile.symm_mem", "benchmarks.timing"} <= set(mods)
    assert any(i.source == "benchmarks.ops" and i.target == "benchmarks.overlap" for i in import_graph())


def test_no_import_cycle_in_the_package():
    found = cycles("fluxcompile")
    assert not found, "import cycles in fluxcompile/:\n" + _cycle_report(found)


def test_no_import_cycle_in_the_benchmarks():
    found = cycles("benchmarks.")
    assert not found, "import cycles in benchmarks/:\n" + _cycle_report(found)


def test_lower_layers_never_import_higher_ones():
    upward = [
        f"{i} (layer {layer_of(i.source)} imports layer {layer_of(i.target)})"
        for i in import_graph()
        if layer_of(i.source) is not None and layer_of(i.target) is not None and layer_of(i.target) > layer_of(i.source)
    ]
    assert not upward, (
        "upward imports (config, ops < symm_mem < kernels, schedules < lowerings < fx_passes < backend):\n  "
        + "\n  ".join(upward)
    )


def test_op_folders_never_import_each_other():
    between = [
        str(i)
        for i in import_graph()
        if op_folder(i.source) and op_folder(i.target) and op_folder(i.source) != op_folder(i.target)
    ]
    assert not between, (
        "imports between op folders (shared things go into symm_mem/, kernels/ or the op's own folder):\n  "
        + "\n  ".join(between)
    )


def test_no_module_imports_another_modules_private_name():
    uses = [u for m in all_modules().values() for u in private_name_uses(m)]
    assert not uses, "private names of other modules (make them public or move them):\n  " + "\n  ".join(uses)


def test_the_product_never_imports_testing():
    found = [
        str(i)
        for i in import_graph()
        if _in(i.target, TESTING)
        and _in(i.source, "fluxcompile")
        and not _in(i.source, TESTING)
        and i.source not in TESTING_CLIENTS
    ]
    assert not found, "the product imports fluxcompile.testing (register test hooks from testing/):\n  " + "\n  ".join(
        found
    )


def test_one_communication_context_class_in_symm_mem():
    defs = definitions(lambda node: isinstance(node, ast.ClassDef) and node.name == "Comm")
    assert len(defs) == 1 and _in(defs[0][0].name, "fluxcompile.symm_mem"), (
        f"one class Comm, in fluxcompile/symm_mem/; found: {_places(defs)}"
    )


def test_one_comm_for_in_symm_mem():
    defs = definitions(lambda node: not isinstance(node, ast.ClassDef) and node.name == "comm_for")
    assert len(defs) == 1 and _in(defs[0][0].name, "fluxcompile.symm_mem"), (
        f"one def comm_for, in fluxcompile/symm_mem/; found: {_places(defs)}"
    )


def test_tile_variants_only_beside_their_kernels():
    defs = definitions(lambda node: isinstance(node, ast.ClassDef) and node.name.endswith("Variant"))
    outside = [(m, node) for m, node in defs if not _in(m.name, "fluxcompile.kernels")]
    per_file: dict[str, list[tuple[Module, ast.AST]]] = {}
    for m, node in defs:
        per_file.setdefault(m.name, []).append((m, node))
    several = [d for d in per_file.values() if len(d) > 1]
    assert not outside, f"Variant classes outside fluxcompile/kernels/: {_places(outside)}"
    assert not several, "more than one Variant class in a kernel family file: " + "; ".join(map(_places, several))


def test_one_cuda_event_timer_in_the_benchmarks():
    """Timing events (``Event(enable_timing=...)``) and ``elapsed_time`` only in benchmarks/timing.py. A plain
    event is no timer: host_cost.py measures what recording and waiting on one costs the host."""
    timers = set()
    for m in benchmark_modules().values():
        for node, _ in _walk(m.tree):
            if m.name == "benchmarks.timing" or not isinstance(node, ast.Call):
                continue
            func = ast.unparse(node.func)
            timing_event = func.endswith("Event") and any(k.arg == "enable_timing" for k in node.keywords)
            if timing_event or func.endswith(".elapsed_time"):
                timers.add(f"{m.where}:{node.lineno}: {func}(...)")
    assert not timers, "CUDA event timers outside benchmarks/timing.py (time through timing.py):\n  " + "\n  ".join(
        sorted(timers)
    )
