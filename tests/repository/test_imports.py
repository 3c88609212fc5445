"""The import graph: no cycles between the project's modules (TYPE_CHECKING and function-level imports count), and
the boundaries the design draws between processes (docs/design.md, Processes)."""

from __future__ import annotations

from collections.abc import Mapping, Set

from tests.repository.source_tree import imported_names, imports, modules


def cycles(graph: Mapping[str, Set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one node (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)

    for root in sorted(graph):
        if root in index:
            continue
        visit(root)
        work = [(root, iter(sorted(graph[root])))]
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    visit(step)
                    work.append((step, iter(sorted(graph.get(step, ())))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while (member := stack.pop()) != node:
                    on_stack.discard(member)
                    component.append(member)
                on_stack.discard(node)
                if component:
                    found.append(sorted(component + [node]))
    return found


def test_no_module_imports_itself_back() -> None:
    assert cycles({module: imports(module) for module in modules()}) == []


def test_a_cycle_is_found_however_it_closes() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert sorted(cycles(graph)) == [["a", "b", "c"], ["d", "e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def _crossings(package: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(f"{module} imports {name}" for module in modules() if module.split(".")[0] == package
                  for name in imported_names(module) if name.split(".")[0] in forbidden)


def test_frontend_and_engine_never_import_each_other() -> None:
    assert _crossings("frontend", ("engine",)) == []
    assert _crossings("engine", ("frontend",)) == []


def test_frontends_and_common_never_import_torch() -> None:
    assert _crossings("frontend", ("torch", "triton", "cupy")) == []
    assert _crossings("common", ("torch", "triton", "cupy")) == []


def test_tests_import_nothing_from_the_bench_lab() -> None:
    assert [line for line in _crossings("tests", ("bench",)) if " bench.lab" in line] == []
