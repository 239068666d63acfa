"""The project's modules import each other in one direction: no import cycle among the modules of the package, its
command line and the benchmarks, counting imports made inside functions too (a deferred import still makes two
modules depend on each other), but not those under `if TYPE_CHECKING:` (never run).

The one shape of cycle allowed is a registry's registration: a registry module (the Fast-LLM converter's `mixers`
and `mlps` tables) ends with one `from .x import ...` line per component module, each of which calls the registry's
`register(...)` when imported. (The model's own registries, `mixer_registry` and `mlp_registry`, import none of
their components: `registered_components` imports them all.) The registry is thereby complete wherever
it is imported (the config validates layer types against it, the converters build their tables from it), and the
component modules are named by the `from .x import` lines that transformers follows when it copies a saved folder's
remote code. Those lines are the registry's last, after everything a component takes from the registry is defined,
so no import order meets a half-built registry. Only these edges are discounted, each named below; any other edge
that closes a cycle fails the test.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hybrid_linear_models", "hybrid_linear_cli")
BENCHMARKS = "benchmarks"  # scripts that import each other by bare name (their folder is on sys.path)

# registry module -> the prefix of the component modules its last lines import (see the module docstring)
REGISTRATIONS = {
    "hybrid_linear_models.conversion.fast_llm.mixers": "hybrid_linear_models.conversion.fast_llm.mixer_",
    "hybrid_linear_models.conversion.fast_llm.mlps": "hybrid_linear_models.conversion.fast_llm.mlp_",
}


def module_files() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    for path in (ROOT / BENCHMARKS).glob("*.py"):
        modules[f"{BENCHMARKS}.{path.stem}"] = path
    return modules


def _runtime_imports(tree: ast.AST):
    """Import nodes that can run: every one except those under `if TYPE_CHECKING:`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in _runtime_imports(ast.Module([child], [])))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _runtime_imports(node)


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The project module `name` is, or lies in (an imported function or class of it); None outside the project."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        in_benchmarks = name.startswith(f"{BENCHMARKS}.")
        for node in _runtime_imports(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                # `from package import submodule` depends on the submodule; `from module import name` on the module
                targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module
                           for alias in node.names]
            if in_benchmarks:  # a bare name is a sibling script
                targets = [f"{BENCHMARKS}.{t}" if f"{BENCHMARKS}.{t.split('.')[0]}" in modules else t for t in targets]
            for target in targets:
                known = _known(target, modules)
                if known is not None and known != name:
                    graph[name].add(known)
    return graph


def _allowed(source: str, target: str) -> bool:
    prefix = REGISTRATIONS.get(source)
    return prefix is not None and target.startswith(prefix)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_graph_sees_the_imports():
    graph = import_graph()
    assert "hybrid_linear_models.configuration_hybrid_linear" in graph["hybrid_linear_models.modeling_hybrid_linear"]
    assert "hybrid_linear_cli.conversion_catalogue" in graph["hybrid_linear_cli.convert"]
    assert "hybrid_linear_models.conversion.api" in graph["hybrid_linear_cli.convert"]  # deferred, inside a function
    assert "benchmarks.model_configs" in graph["benchmarks.bench_generation"]  # a sibling script by bare name


def test_a_cycle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_but_the_registrations():
    graph = import_graph()
    for registry, prefix in REGISTRATIONS.items():
        assert any(target.startswith(prefix) for target in graph[registry]), f"{registry} registers nothing"
    pruned = {source: {target for target in targets if not _allowed(source, target)}
              for source, targets in graph.items()}
    found = cycles(pruned)
    described = ["; ".join(f"{m} -> {sorted(t for t in pruned[m] if t in component)}" for m in component)
                 for component in found]
    assert not found, "import cycles:\n" + "\n".join(described)


def test_the_command_line_imports_the_library_only_inside_functions():
    """`hybrid_linear_cli` answers --help and refuses bad input without torch: at import time none of its modules
    imports `hybrid_linear_models` (whose package imports torch and transformers); the library imports the CLI's
    plain-data modules, and the CLI reaches the library only once there is work to do."""
    modules = module_files()
    for name, path in modules.items():
        if not name.startswith("hybrid_linear_cli"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top_level = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
        for node in top_level:
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            assert not any(n.split(".")[0] == "hybrid_linear_models" for n in names), (name, ast.unparse(node))
