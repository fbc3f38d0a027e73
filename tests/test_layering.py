"""The import graph of llmflow's sources: no module imports another that (through any chain)
imports it back, nor does any module or package import a sibling (one in the same package)
whose modules import it back, and imports point one way, flows -> tasks -> llmflow core ->
models -> kernels, with the command line above them all.
Read from the source files with ``ast``, every import statement counted (inside functions
and ``if TYPE_CHECKING`` blocks too)."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"llmflow.flows": "flows", "llmflow.tasks": "tasks", "llmflow.models": "models",
            "llmflow.kernels": "kernels", "llmflow": "llmflow"}
LAYERS = [("llmflow.kernels",), ("llmflow.models",), ("llmflow",), ("llmflow.tasks",), ("llmflow.flows",),
          ("llmflow.cli", "llmflow.demo")]
"""Lowest first: a module may import its own layer and the ones before it. The command line
is the front door above them all (``llmflow demo`` runs the finetune-and-eval flow)."""


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def imports(path: Path, known: set[str]) -> set[str]:
    """The llmflow modules ``path`` imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module
                      for alias in node.names}
    return {name for name in names if name in known}


def layer(module: str) -> int:
    return max(i for i, prefixes in enumerate(LAYERS) for prefix in prefixes
               if module == prefix or module.startswith(prefix + "."))


def import_graph() -> nx.DiGraph:
    found = modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(found)
    for module, path in found.items():
        graph.add_edges_from((module, imported) for imported in imports(path, set(found)))
    return graph


def test_the_sources_are_read():
    graph = import_graph()
    assert {"llmflow.cli", "llmflow.flows.finetune_eval", "llmflow.models.decoder", "llmflow.kernels.fused",
            "llmflow.probe.dump.dumper", "llmflow.probe.compare.tables"} <= set(graph)
    assert ("llmflow.infer.command", "llmflow.infer.generator") in graph.edges


def test_no_import_cycles():
    cycles = sorted(sorted(c) for c in nx.simple_cycles(import_graph()))
    assert cycles == []


def sibling_edge(importer: str, imported: str) -> tuple[str, str] | None:
    """The siblings (children of their nearest common package) that ``importer`` and ``imported``
    belong to; None when one holds the other."""
    a, b = importer.split("."), imported.split(".")
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    if common in (len(a), len(b)):
        return None
    return ".".join(a[:common + 1]), ".".join(b[:common + 1])


def test_no_import_cycles_between_siblings():
    """A cycle between two packages, or a package and a module beside it, is a cycle in their
    order even when no single module takes part in one (llmflow.launch importing the node
    layout from llmflow.cluster, whose launcher imports llmflow.launch)."""
    edges = (sibling_edge(a, b) for a, b in import_graph().edges)
    cycles = sorted(sorted(c) for c in nx.simple_cycles(nx.DiGraph(edge for edge in edges if edge)))
    assert cycles == []


def test_imports_point_down_the_layers():
    graph = import_graph()
    upward = sorted((a, b) for a, b in graph.edges if layer(b) > layer(a) and not a.startswith(b + "."))
    assert upward == []
