"""The benchmarks import each other's helpers: every name one takes from another must
still be defined there (a benchmark is run by hand, so a renamed helper would otherwise
be found only when someone runs it). Read from the source, so the benchmarks' own
dependencies (the `bench` extra) need not be installed."""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _defined(module: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def test_every_name_a_benchmark_imports_from_another_is_defined_there() -> None:
    modules = {p.stem: p for p in BENCH.glob("*.py")}
    missing = []
    checked = 0
    for name, path in sorted(modules.items()):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            parts = node.module.split(".")
            if parts[0] != "bench" or len(parts) != 2 or parts[1] not in modules:
                continue
            defined = _defined(modules[parts[1]])
            for alias in node.names:
                checked += 1
                if alias.name not in defined:
                    missing.append(f"bench/{name}.py: {alias.name} from {node.module}")
    assert checked > 0  # the benchmarks do share helpers: the scan found them
    assert missing == []
