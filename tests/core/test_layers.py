"""The crates and modules keep the layering of docs/architecture.md: no module of a crate imports one
that imports it back, and the router never links the engine model or the emulator."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from ..conftest import REPO

CRATES = ["ppd-core", "ppd-model", "ppd-server", "ppd-emulator", "ppd-py"]


def top_module(src: Path, f: Path) -> str:
    """`route` for src/route.rs, `connector` for src/connector/nixl.rs, `` for lib.rs."""
    rel = f.relative_to(src).with_suffix("")
    return "" if rel.parts in (("lib",), ("main",)) else rel.parts[0]


def code_of(f: Path) -> str:
    """The non-test code of a file, without comments (doc links are not imports)."""
    text = re.split(r"#\[cfg\(test\)\]", f.read_text())[0]
    return "\n".join(line.split("//")[0] for line in text.splitlines())


def module_graph(crate: str) -> dict[str, set[str]]:
    src = REPO / "rust" / crate / "src"
    graph: dict[str, set[str]] = {}
    for f in src.rglob("*.rs"):
        if "bin" in f.relative_to(src).parts:
            continue
        m = top_module(src, f)
        if not m:
            continue
        deps = {d for d in re.findall(r"\bcrate::([a-z_][a-z0-9_]*)", code_of(f)) if d != m}
        graph.setdefault(m, set()).update(deps)
    return {m: {d for d in deps if d in graph} for m, deps in graph.items()}


def cycle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A path start -> ... -> start, if there is one."""
    stack = [(start, [start])]
    seen: set[str] = set()
    while stack:
        node, path = stack.pop()
        for nxt in graph.get(node, ()):
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*path, nxt]))
    return None


@pytest.mark.parametrize("crate", CRATES)
def test_no_module_imports_one_that_imports_it_back(crate: str) -> None:
    graph = module_graph(crate)
    assert len(graph) >= 3, f"{crate}: the module graph was not read"
    cycles = [c for m in sorted(graph) if (c := cycle_through(graph, m))]
    assert not cycles, f"{crate}: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_sees_a_cycle() -> None:
    assert cycle_through({"a": {"b"}, "b": {"c"}, "c": {"a"}}, "a") == ["a", "b", "c", "a"]
    assert cycle_through({"a": {"b"}, "b": set()}, "a") is None


def test_the_router_links_the_core_only() -> None:
    deps = tomllib.loads((REPO / "rust" / "ppd-server" / "Cargo.toml").read_text())["dependencies"]
    ours = sorted(d for d in deps if d.startswith("ppd-"))
    assert ours == ["ppd-core"]
