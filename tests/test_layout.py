"""The package's layout holds: no import circle between serval's modules, and no module-level switch in the kernels.

Imports are read from the source (ast), counting every `import` of a serval module anywhere in a module (a
function-level import is still a dependency), so this runs without importing anything heavy.
"""

import ast
import pathlib

import serval

ROOT = pathlib.Path(serval.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = ("serval",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, name: str, modules) -> set[str]:
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from package import module` depends on the module; `from module import name` on the module
            candidates = [f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in modules]
            if len(candidates) < len(node.names):
                candidates.append(target)
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        found.update(c for c in candidates if c.startswith("serval"))
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        # a package's __init__ re-exports its modules; a module importing a package depends on its __init__ only
        graph[name] = {t for t in _imports(path, name, modules) if t in modules and t != name}
    return graph


def test_no_import_circle():
    graph = _graph()
    done, stack = set(), []

    def visit(node):
        if node in stack:
            cycle = stack[stack.index(node):] + [node]
            raise AssertionError("import circle: " + " -> ".join(cycle))
        if node in done:
            return
        stack.append(node)
        for dep in sorted(graph[node]):
            visit(dep)
        stack.pop()
        done.add(node)

    for module in sorted(graph):
        visit(module)


def test_kernels_and_transport_meet_only_in_peers():
    """The peer-row addressing both need lives in serval.peers; the kernels never import the transports."""
    graph = _graph()
    for name, deps in graph.items():
        if name.startswith("serval.kernels"):
            assert not any(d.startswith("serval.transport") for d in deps), (name, deps)


def test_no_module_level_switches_in_kernels():
    """Behaviour is chosen by the KernelPlan passed down, not by module globals: no kernel module binds an
    upper-case name to a mutable value (a dict, list or set) or a bool at module level (tables are read-only)."""
    for path in (ROOT / "kernels").glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id.isupper() for t in node.targets):
                value = node.value
                mutable = isinstance(value, (ast.Dict, ast.List, ast.Set)) or (
                    isinstance(value, ast.Constant) and isinstance(value.value, bool))
                assert not mutable, f"{path.name}: module-level switch {ast.unparse(node)[:80]}"
