"""The package map of docs/design.md, enforced: imports go one way, files stay one concept.

Layers, lowest first: `files` and `ops` ← `model` ← `engine` ← (`train`, `rollout`, `envs`) ←
(`check`, `serve`, `eval`, `run`, `config`) ← `cli`. A package may import from a lower layer, or
from a package of its own layer as long as no cycle forms; never from a higher one, and never a
name another package keeps private (a leading underscore).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "rzero"
LAYERS = {
    "files": 0,
    "ops": 0,
    "model": 1,
    "engine": 2,
    "train": 3,
    "rollout": 3,
    "envs": 3,
    "check": 4,
    "serve": 4,
    "eval": 4,
    "run": 4,
    "config": 4,
    "cli": 5,
}
MAX_LINES = 400


def package_of(path: Path) -> str | None:
    """`ops` for src/rzero/ops/x.py, `config` for src/rzero/config.py, None for rzero/__init__.py."""
    parts = path.relative_to(SRC).with_suffix("").parts
    return None if parts == ("__init__",) else parts[0]


def imports(tree: ast.AST) -> list[tuple[str, list[str], int]]:
    """(imported rzero module, names taken from it, line) for every import, lazy ones included."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.split(".")[0] == "rzero":
            if node.module == "rzero":  # `from rzero import ops`: each name is a package
                found += [(f"rzero.{a.name}", [], node.lineno) for a in node.names]
            else:
                found.append((node.module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == "rzero"]
    return found


def package_edges() -> dict[tuple[str, str], list[str]]:
    """(importer, imported) package pairs, each with the places it happens."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        src = package_of(path)
        for module, names, line in imports(ast.parse(path.read_text(), str(path))):
            parts = module.split(".")
            dst = parts[1] if len(parts) > 1 else None
            if src is None or dst is None or dst == src:
                continue
            edges.setdefault((src, dst), []).append(f"{path.relative_to(SRC)}:{line}")
    return edges


def test_every_package_has_a_layer():
    packages = {package_of(p) for p in SRC.rglob("*.py")} - {None}
    assert packages <= set(LAYERS), f"add these to the package map (docs/design.md): {packages - set(LAYERS)}"


def test_no_import_goes_up_a_layer():
    upward = [
        f"{a} (layer {LAYERS[a]}) imports {b} (layer {LAYERS[b]}) at {', '.join(where)}"
        for (a, b), where in package_edges().items()
        if LAYERS[b] > LAYERS[a]
    ]
    assert not upward, "\n".join(upward)


def test_no_cycle_between_packages():
    graph: dict[str, set[str]] = {}
    for a, b in package_edges():
        graph.setdefault(a, set()).add(b)
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path + [node, nxt]
            if nxt not in state and (cycle := visit(nxt, path + [node])):
                return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [])):
            pytest.fail("package cycle: " + " -> ".join(cycle[cycle.index(cycle[-1]):]))


def test_no_private_name_crosses_a_package():
    leaks = []
    for path in sorted(SRC.rglob("*.py")):
        src = package_of(path)
        for module, names, line in imports(ast.parse(path.read_text(), str(path))):
            parts = module.split(".")
            other_package = len(parts) > 1 and parts[1] != src
            private = [n for n in names if n.startswith("_")] + [p for p in parts if p.startswith("_") and p != "__init__"]
            if other_package and private:
                leaks.append(f"{path.relative_to(SRC)}:{line} imports {', '.join(private)} from {module}")
    assert not leaks, "\n".join(leaks)


def test_no_source_file_holds_more_than_one_concept_worth_of_lines():
    long = [f"{p.relative_to(SRC)}: {n} lines" for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, f"split these along their seams (at most {MAX_LINES} lines):\n" + "\n".join(long)


def test_the_checks_detect_what_they_forbid(tmp_path, monkeypatch):
    """Negative control: an upward import and a two-package cycle are found."""
    fake = tmp_path / "rzero"
    for rel, text in {
        "ops/a.py": "from rzero.engine import Engine\n",  # upward: ops imports engine
        "engine/b.py": "from rzero.ops.a import x\n",
        "train/c.py": "from rzero.rollout import y\n",
        "rollout/d.py": "def f():\n    from rzero.train.c import _z\n",  # cycle + private name
    }.items():
        (fake / rel).parent.mkdir(parents=True, exist_ok=True)
        (fake / rel).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "SRC", fake)
    with pytest.raises(AssertionError, match="ops \\(layer 0\\) imports engine"):
        test_no_import_goes_up_a_layer()
    with pytest.raises(pytest.fail.Exception, match="package cycle"):
        test_no_cycle_between_packages()
    with pytest.raises(AssertionError, match="imports _z from rzero.train.c"):
        test_no_private_name_crosses_a_package()
