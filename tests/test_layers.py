"""The package's layering (docs/contracts.md, "Layers"): no module imports a module of a layer above it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "jaxrl_mismatch"


def layer_table() -> dict[str, int]:
    """module prefix -> layer, read from the table in docs/contracts.md."""
    text = (REPO / "docs" / "contracts.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    table: dict[str, int] = {}
    for row in re.finditer(r"^\| (\d+) \| ([^|]+) \|", section, re.M):
        for name in re.findall(r"`([\w.]+)`", row.group(2)):
            table[name] = int(row.group(1))
    return table


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every jaxrl_mismatch module imported anywhere in the file (function-level imports included)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("jaxrl_mismatch"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxrl_mismatch"):
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)  # `from pkg import module`
    return out


def layer_of(module: str, table: dict[str, int]) -> int | None:
    best = max((p for p in table if module == p or module.startswith(p + ".")), key=len, default=None)
    return None if best is None else table[best]


def test_every_package_module_has_a_layer():
    table = layer_table()
    assert {"jaxrl_mismatch.train", "jaxrl_mismatch.cli", "jaxrl_mismatch.rollout"} <= set(table)
    missing = [module_name(p) for p in PKG.rglob("*.py") if layer_of(module_name(p), table) is None
               and module_name(p) != "jaxrl_mismatch"]
    assert missing == []


def test_no_import_points_up():
    table = layer_table()
    upward = []
    for path in PKG.rglob("*.py"):
        me = module_name(path)
        mine = layer_of(me, table)
        if mine is None:
            continue
        for target in imports_of(path):
            theirs = layer_of(target, table)
            if theirs is not None and theirs > mine:
                upward.append(f"{me} (layer {mine}) imports {target} (layer {theirs})")
    assert upward == []


def test_rollout_client_and_server_do_not_import_each_other():
    rollout = PKG / "rollout"
    assert not any(m.startswith("jaxrl_mismatch.rollout.server") for m in imports_of(rollout / "client.py"))
    assert not any(m.startswith("jaxrl_mismatch.rollout.client") for m in imports_of(rollout / "server.py"))


def test_the_check_catches_an_upward_import(tmp_path):
    """The checker itself: a models module importing train would be reported."""
    table = layer_table()
    assert layer_of("jaxrl_mismatch.models.model", table) < layer_of("jaxrl_mismatch.train.loop", table)
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from jaxrl_mismatch.train import loop\n")
    assert "jaxrl_mismatch.train.loop" in imports_of(bad)
