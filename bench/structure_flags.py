"""The flags walk of bench/structure.py (its figure 4), from `pretrain_gpt.main`: follow the parsed flags (the
namespace `parse_args` returns, and the resolved flag dictionary `RunConfig.flags`, also inside a dict literal that
carries it) through the calls they are passed to. A stop is a function that receives them as an argument; a climb
back is a stop on a higher floor than its caller (the flags handed up the import graph, `structure.floors`); a
return is a stop that returns a value it read from them."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from structure import Module, _modules, _room, floors  # bench/structure.py, beside this script


@dataclass
class Function:
    key: str  # module:qualname
    module: Module
    node: ast.AST
    cls: str | None = None
    params: list[str] = field(default_factory=list)


def _functions(modules) -> dict[str, Function]:
    found = {}
    for module in modules.values():
        for node in module.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found[f"{module.name}:{node.name}"] = Function(f"{module.name}:{node.name}", module, node,
                                                               params=[a.arg for a in _args(node)])
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        key = f"{module.name}:{node.name}.{item.name}"
                        found[key] = Function(key, module, item, node.name, [a.arg for a in _args(item)])
    return found


def _args(node):
    a = node.args
    return a.posonlyargs + a.args + a.kwonlyargs


def _names_in_scope(module: Module) -> dict[str, str]:
    """{local name: module:qualname or module name} for what a module imports from mpzero or defines."""
    scope = {}
    for node in module.tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope[node.name] = f"{module.name}:{node.name}"
    for node in ast.walk(module.tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                scope[alias.asname or alias.name] = f"{node.module}:{alias.name}"
    return scope


def _resolve(modules, functions, ref: str, seen=None) -> str | None:
    """A module:name reference, followed through re-exports (a package's __init__) to the function or class."""
    seen = seen or set()
    if ref in functions or ref in seen:
        return ref if ref in functions else None
    seen.add(ref)
    module_name, _, name = ref.partition(":")
    module = modules.get(module_name)
    if module is None:
        return None
    for node in module.tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return f"{module_name}:{name}.__init__" if f"{module_name}:{name}.__init__" in functions else None
    target = _names_in_scope(module).get(name)
    if target and target != ref:
        return _resolve(modules, functions, target, seen)
    return None


def _is_flags(expr, tainted: set[str]) -> bool:
    if isinstance(expr, ast.Name):
        return expr.id in tainted
    if isinstance(expr, ast.Attribute):
        return expr.attr == "flags" and not (isinstance(expr.value, ast.Name) and expr.value.id == "self")
    if isinstance(expr, ast.Dict):  # a record that carries them (a checkpoint's meta: {"config": run.flags})
        return any(_is_flags(v, tainted) for v in expr.values)
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id in ("vars", "dict"):
        return any(_is_flags(a, tainted) for a in expr.args)
    return False


def _reads_flags(expr, tainted) -> bool:
    return any(_is_flags(n, tainted) for n in ast.walk(expr))


def flags_walk(root: str, start: str = "pretrain_gpt:main") -> dict:
    modules = _modules(root, ("mpzero", "pretrain_gpt.py"))
    functions = _functions(modules)
    floor, _, _ = floors(modules)
    top = max(floor.values()) + 1
    floor.update({room: top for room in floor if f"mpzero.{room}" not in modules and not any(
        m.startswith(f"mpzero.{room}.") for m in modules)})  # the scripts sit above the whole library
    stops, climbs, returns, visited = {}, set(), set(), set()
    queue = [(start, frozenset())]
    while queue:
        key, given = queue.pop()
        if (key, given) in visited:
            continue
        visited.add((key, given))
        function = functions[key]
        scope = _names_in_scope(function.module)
        tainted = {p for p in given}
        changed = True
        while changed:  # names bound to the flags (parse_args's result, vars(flags), run.flags) in this function
            changed = False
            for node in ast.walk(function.node):
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                    value, name = node.value, node.targets[0].id
                    parsed = isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and \
                        value.func.id == "parse_args"
                    if name not in tainted and (parsed or _is_flags(value, tainted)):
                        tainted.add(name)
                        changed = True
        if given and any(isinstance(n, ast.Return) and n.value is not None and _reads_flags(n.value, tainted)
                         for n in ast.walk(function.node)):
            returns.add(key)
        for call in (n for n in ast.walk(function.node) if isinstance(n, ast.Call)):
            callee = None
            if isinstance(call.func, ast.Name) and call.func.id in scope:
                callee = _resolve(modules, functions, scope[call.func.id])
            elif isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name) \
                    and call.func.value.id == "self" and function.cls:
                candidate = f"{function.module.name}:{function.cls}.{call.func.attr}"
                callee = candidate if candidate in functions else None
            if callee is None:
                continue
            target = functions[callee]
            params = target.params[1:] if target.cls else target.params
            passed = set()
            for k, arg in enumerate(call.args):
                if _is_flags(arg, tainted) and k < len(params):
                    passed.add(params[k])
            for keyword in call.keywords:
                if keyword.arg and _is_flags(keyword.value, tainted):
                    passed.add(keyword.arg)
            if passed:
                stops.setdefault(callee, key)
                here, there = _room(function.module.name), _room(target.module.name)
                if floor.get(there, 0) > floor.get(here, 0):
                    climbs.add((key, callee))
            queue.append((callee, frozenset(passed)))
    return {"stops": sorted(stops), "climbs": sorted(climbs), "returns": sorted(returns)}


# -- the report -----------------------------------------------------------------------------------------------------
