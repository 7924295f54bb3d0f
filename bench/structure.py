"""The structure figures of issue 22, read from the source with `ast` (nothing is imported or run):

    python bench/structure.py [ROOT]          # ROOT: a checkout of mpzero (default: this one)
    git worktree add /tmp/before 5c3a95e && python bench/structure.py /tmp/before

1. Back arrows between mpzero's folders. A room is a top-level entry of mpzero/ (a package folder, with its
   subpackages, or a ground-floor module; a second figure counts zero/offload as a room of its own); room A points
   at room B when a module of A imports one of B at module level (imports inside a function are lazy and draw no
   arrow). Floors: a room with no arrows out is floor 0,
   any other one floor above the highest it points at; inside a cycle the fewest arrows are cut, and those are the
   back arrows.
2. Deep cross-package imports: an import (lazy ones too) in mpzero/ of a module that is not a package, from a
   module that is neither in that module's package nor in a subpackage of it: it should go through the package's
   `__init__`. Counted as statements and files, and listed; outside mpzero/ (tools, bench, examples,
   pretrain_gpt.py) as a figure too. `deep_imports(root)` is what tests/test_package_faces.py asserts on.
3. Functions over 60 lines (`def` line to last line, nested functions counted on their own) in mpzero/, tools/,
   bench/, examples/ and pretrain_gpt.py.
4. The flags walk from `pretrain_gpt.main` (bench/structure_flags.py says what it follows).
"""

from __future__ import annotations

import ast
import itertools
import os
import sys
from collections import defaultdict
from dataclasses import dataclass

LONG = 60
OUTSIDE = ("tools", "bench", "examples", "pretrain_gpt.py")


# -- modules ------------------------------------------------------------------------------------------------------

@dataclass
class Module:
    name: str  # dotted: mpzero.zero.stage3, pretrain_gpt, tools.export_hf
    path: str
    tree: ast.Module
    is_package: bool


def _modules(root: str, tops=("mpzero",) + OUTSIDE) -> dict[str, Module]:
    found = {}
    for top in tops:
        base = os.path.join(root, top)
        paths = [base] if top.endswith(".py") else [os.path.join(d, f) for d, _, fs in os.walk(base)
                                                    for f in fs if f.endswith(".py")]
        for path in sorted(paths):
            if not os.path.isfile(path):
                continue
            rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
            is_package = rel.endswith(".__init__")
            name = rel[:-len(".__init__")] if is_package else rel
            with open(path, encoding="utf-8") as f:
                found[name] = Module(name, path, ast.parse(f.read(), path), is_package)
    return found


def _package_of(module: Module) -> str:
    return module.name if module.is_package else module.name.rpartition(".")[0]


def _imports(module: Module, lazy: bool = True):
    """(node, imported module name, names imported from it or None, at module level?) per import: `from P import
    m` where m is a submodule of P counts as an import of P.m."""
    top_level = {id(n) for n in _module_level_nodes(module.tree)}
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node, alias.name, None, id(node) in top_level
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node, node.module, [a.name for a in node.names], id(node) in top_level


def _module_level_nodes(tree: ast.Module):
    """Statements that run at import: the module body and its if/try blocks, not functions, not TYPE_CHECKING."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for part in ("body", "orelse", "finalbody", "handlers"):
                stack.extend(getattr(node, part, []))
        elif isinstance(node, ast.ExceptHandler):
            stack.extend(node.body)


def _bound_names(module: Module) -> set[str]:
    """Names a package's __init__ binds at module level: `from P import m` gives these, not the submodule P.m."""
    bound = set()
    for node in module.tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.Assign):
            bound.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return bound


def _targets(modules, name: str, names) -> list[str]:
    """The mpzero modules an import statement loads by name (a `from P import m` of a submodule m included)."""
    if name not in modules:
        return []
    bound = _bound_names(modules[name]) if modules[name].is_package else set()
    subs = [f"{name}.{n}" for n in names or () if f"{name}.{n}" in modules and n not in bound]
    return subs + ([name] if not subs or len(subs) < len(names or ()) else [])


# -- 1. rooms, arrows, floors -------------------------------------------------------------------------------------

SUBFOLDERS = False  # True: a subpackage (zero/offload) is a room of its own


def _room(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] == "mpzero":
        if SUBFOLDERS and len(parts) >= 3 and parts[:3] == ["mpzero", "zero", "offload"]:
            return "zero/offload"
        return parts[1] if len(parts) > 1 else None
    return parts[0]  # pretrain_gpt, tools, bench, examples: above the library


def arrows(modules) -> dict[tuple[str, str], int]:
    """{(from room, to room): module-level import statements} between mpzero's rooms (and the scripts above)."""
    counted = defaultdict(int)
    for module in modules.values():
        here = _room(module.name)
        for _, name, names, top in _imports(module):
            if not top or here is None:
                continue
            for target in _targets(modules, name, names):
                there = _room(target)
                if there is not None and there != here and target.startswith("mpzero."):
                    counted[here, there] += 1
    return dict(counted)


def _components(rooms, edges):
    """Strongly connected components (Tarjan), each a list of rooms."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], itertools.count()
    succ = defaultdict(list)
    for a, b in edges:
        succ[a].append(b)

    def visit(v):
        index[v] = low[v] = next(counter)
        stack.append(v)
        on.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            out.append(component)

    sys.setrecursionlimit(10000)
    for v in sorted(rooms):
        if v not in index:
            visit(v)
    return out


def floors(modules) -> tuple[dict[str, int], list[tuple[str, str]], dict]:
    """({room: floor}, back arrows, arrows). Inside a cycle the order with the fewest arrows running up is taken
    (exhaustively up to 8 rooms; beyond that, by each room's arrows out minus in)."""
    edges = arrows(modules)
    rooms = {r for e in edges for r in e} | {_room(m) for m in modules if _room(m)}
    back = []
    for component in _components(rooms, edges):
        if len(component) == 1:
            continue
        inner = [(a, b) for (a, b) in edges if a in component and b in component]
        if len(component) <= 8:
            orders = itertools.permutations(component)
        else:
            orders = [sorted(component, key=lambda r: sum(edges.get((r, o), 0) - edges.get((o, r), 0)
                                                          for o in component))]
        best = None
        for order in orders:  # order[0] lowest: an arrow from lower to higher runs back up
            rank = {r: k for k, r in enumerate(order)}
            up = [(a, b) for (a, b) in inner if rank[a] < rank[b]]
            if best is None or len(up) < len(best):
                best = up
        back.extend(best)
    down = {e: n for e, n in edges.items() if e not in back}
    floor = {}

    def height(room, seen=()):
        if room not in floor:
            outs = [b for (a, b) in down if a == room]
            floor[room] = 1 + max((height(b) for b in outs), default=-1)
        return floor[room]
    for room in rooms:
        height(room)
    return floor, sorted(back), edges


# -- 2. deep imports ------------------------------------------------------------------------------------------------

def deep_imports(root: str, tops=("mpzero",)) -> list[tuple[str, int, str]]:
    """(file relative to root, line, imported module) for each import of another package's submodule."""
    modules = _modules(root)
    deep = []
    for module in modules.values():
        if not module.name.startswith(tuple(t.removesuffix(".py") for t in tops)):
            continue
        home = _package_of(module)
        for node, name, names, _ in _imports(module):
            for target in _targets(modules, name, names):
                imported = modules[target]
                owner = _package_of(imported)
                if imported.is_package or owner == "mpzero" or not target.startswith("mpzero."):
                    continue  # a package's face, or a ground-floor module
                if home == owner or home.startswith(owner + "."):
                    continue  # its own package's modules, or a parent package's
                deep.append((os.path.relpath(module.path, root), node.lineno, target))
    return sorted(deep)


# -- 3. long functions ----------------------------------------------------------------------------------------------

def long_functions(root: str, limit: int = LONG) -> list[tuple[int, str]]:
    out = []
    for module in _modules(root).values():
        for node in ast.walk(module.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    out.append((lines, f"{os.path.relpath(module.path, root)}:{node.lineno} {node.name}"))
    return sorted(out, reverse=True)


def main(argv=None) -> dict:
    root = os.path.abspath((argv or sys.argv[1:] or [os.path.join(os.path.dirname(__file__), "..")])[0])
    modules = _modules(root)
    floor, back, edges = floors({k: m for k, m in modules.items() if k.startswith("mpzero")})
    inside = deep_imports(root)
    outside = deep_imports(root, OUTSIDE)
    long = long_functions(root)
    from structure_flags import flags_walk  # beside this script; it reads this module's graph, so not at the top
    walk = flags_walk(root)
    print(f"rooms {len(floor)} | floors {max(floor.values()) + 1} | arrows {len(edges)} | back arrows {len(back)}"
          + (": " + ", ".join(f"{a} -> {b}" for a, b in back) if back else ""))
    global SUBFOLDERS
    SUBFOLDERS = True  # the same with zero/offload a room of its own: the cycle item 2 named, inside zero/
    _, inner_back, _ = floors({k: m for k, m in modules.items() if k.startswith("mpzero")})
    SUBFOLDERS = False
    print(f"back arrows with zero/offload a room of its own: {len(inner_back)}"
          + (": " + ", ".join(f"{a} -> {b}" for a, b in inner_back) if inner_back else ""))
    print(f"deep cross-package imports in mpzero/: {len(inside)} in {len({f for f, _, _ in inside})} files | "
          f"in tools, bench, examples, pretrain_gpt.py: {len(outside)} in {len({f for f, _, _ in outside})} files")
    for path, line, target in inside:
        print(f"    {path}:{line} {target}")
    print(f"functions over {LONG} lines: {len(long)}")
    for lines, where in long:
        print(f"    {lines:4d} {where}")
    print(f"flags walk from pretrain_gpt.main: {len(walk['stops'])} stops / {len(walk['climbs'])} climbs back / "
          f"{len(walk['returns'])} returns")
    for stop in walk["stops"]:
        print(f"    stop {stop}" + ("  (returns from the flags)" if stop in walk["returns"] else ""))
    for caller, callee in walk["climbs"]:
        print(f"    climb {caller} -> {callee}")
    return {"back": back, "deep": inside, "long": long, "walk": walk}


if __name__ == "__main__":
    main()
