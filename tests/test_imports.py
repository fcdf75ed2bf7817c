"""The import rules of the code's rooms, read from every import statement (``ast``), so that a
change cannot quietly make a lower room depend on a higher one. The rooms and the arrows allowed
between them are drawn in docs/architecture.md (section "Rooms and the arrows between them");
``ALLOWED`` below is that table as data.

Rules:
* ``moe/``, ``optim/``, ``pipeline/`` import nothing of ``k3train``;
* only ``k3train/cli.py``, ``k3train/__main__.py`` and ``k3train/commands/`` import the commands;
* every import between rooms follows an arrow of ``ALLOWED``;
* no import cycle between modules (imports inside functions count; ``if TYPE_CHECKING:`` ones
  do not; ``from . import x`` of a submodule is an edge to that submodule);
* outside the commands no function imports a project module (third parties may be imported
  lazily, for import time or because they are optional), except the modules that themselves
  need an optional third party at import (``OPTIONAL_PROJECT``).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("k3train", "moe", "optim", "pipeline")

# room -> rooms it may import (its own room is always allowed)
_BASE = {"errors", "root"}
ALLOWED = {
    "root": set(),
    "errors": set(),
    "config": _BASE,
    "runtime": _BASE | {"config"},
    "leaf": {"leaf"},
    "ops": _BASE | {"config", "runtime", "leaf"},
    "quant": _BASE | {"config", "runtime", "ops", "leaf"},
    "model": _BASE | {"config", "runtime", "ops", "quant", "leaf"},
    "data": _BASE | {"config", "runtime"},
    "hf": _BASE | {"config", "runtime", "ops", "quant", "model", "data", "leaf"},
    "trainer": _BASE | {"config", "runtime", "ops", "quant", "model", "data", "hf", "leaf"},
}
for _upper in ("infer", "profiling", "sweep"):
    ALLOWED[_upper] = ALLOWED["trainer"] | {"trainer"}
ALLOWED["commands"] = set(ALLOWED) - {"commands"}

# Project modules that import an optional third party (triton) at module level: a function
# imports them lazily so that a plain install never needs it.
OPTIONAL_PROJECT = {"moe.topk_triton", "moe.permute_triton", "moe.balancing_triton",
                    "optim.momentum_triton", "optim.ns_gemm_triton", "k3train.ops.short_conv_triton"}

# Today's exceptions, each to be removed (the last test fails on a stale entry, so this only shrinks).
KNOWN_VIOLATIONS: set[tuple[str, str, str]] = set()


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def room(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "k3train":
        return "leaf"
    if len(parts) == 1:
        return "root"
    if parts[1] in ("cli", "__main__", "commands"):
        return "commands"
    return parts[1]


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module):
    """(node, inside_function) for every import, skipping ``if TYPE_CHECKING:`` blocks."""
    def walk(node, in_fn):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    yield from walk(sub, in_fn)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, in_fn
            yield from walk(child, in_fn or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
    yield from walk(tree, False)


def edges() -> list[tuple[str, str, int, bool, str]]:
    """(importer, imported project module, line, inside a function, top-level name imported)."""
    mods = _modules()
    out = []
    for mod, path in mods.items():
        pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node, in_fn in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for target in targets:
                top = target.split(".")[0]
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                out.append((mod, target or top, node.lineno, in_fn, top))
    return out


def _violations() -> list[tuple[tuple[str, str, str], str]]:
    mods = _modules()
    found = []
    for src, dst, line, in_fn, top in edges():
        where = f"{mods[src].relative_to(ROOT)}:{line}"
        if dst not in mods:  # a third party: required ones may be lazy too (import cost only)
            continue
        if src == dst:
            continue
        a, b = room(src), room(dst)
        if a != b and b not in ALLOWED[a]:
            found.append(((src, dst, "arrow"), f"{where}: {src} ({a}) imports {dst} ({b}): not an arrow of ALLOWED"))
        if in_fn and a != "commands" and dst not in OPTIONAL_PROJECT:
            found.append(((src, dst, "local"), f"{where}: {src} imports {dst} inside a function; import it at "
                                               f"module level (only optional third parties are lazy)"))
    return found


def _cycles() -> list[list[str]]:
    graph: dict[str, set[str]] = {}
    mods = _modules()
    for src, dst, *_ in edges():
        if dst in mods and dst != src:
            graph.setdefault(src, set()).add(dst)
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            strong(v)
    return out


def test_the_reader_sees_the_imports_it_must_judge():
    """The checker itself, on imports known to be in the tree: a module-level one, a relative
    submodule import inside a function (an edge to the submodule, not the package), an import
    guarded by TYPE_CHECKING (not an edge), and the room of each kind of module."""
    found = {(s, d): in_fn for s, d, _, in_fn, _ in edges()}
    assert found[("k3train.trainer.loop", "k3train.trainer.restore")] is False
    assert found[("moe.topk", "moe.topk_triton")] is True and ("moe.topk", "moe") not in found
    assert len(found) > 300
    assert [room(m) for m in ("k3train", "k3train.cli", "k3train.commands.train", "k3train.ops.kda.naive",
                              "moe.layer")] == ["root", "commands", "commands", "ops", "leaf"]
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import k3train.cli\n"
                     "def f():\n    import k3train.errors\n")
    assert [(type(n).__name__, in_fn) for n, in_fn in _imports(tree)] == [("ImportFrom", False), ("Import", True)]


def test_leaf_packages_never_import_k3train():
    bad = [(s, d) for s, d, *_ in edges() if room(s) == "leaf" and d.split(".")[0] == "k3train"]
    assert not bad, bad


def test_only_the_front_door_imports_the_commands():
    bad = [(s, d) for s, d, *_ in edges() if room(d) == "commands" and room(s) != "commands"]
    assert not bad, bad


def test_no_import_cycle():
    assert not _cycles(), _cycles()


def test_rooms_follow_the_allowed_arrows_and_imports_are_at_module_level():
    new = [msg for key, msg in _violations() if key not in KNOWN_VIOLATIONS]
    assert not new, "\n".join(new)


def test_known_violations_are_not_stale():
    stale = KNOWN_VIOLATIONS - {key for key, _ in _violations()}
    assert not stale, f"remove these fixed entries from KNOWN_VIOLATIONS: {sorted(stale)}"
