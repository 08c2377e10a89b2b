"""
The import graph of a package, and its circles.

Reads the sources with ``ast`` (nothing is imported, so a circle that would
only fail at run time is seen before it runs) and draws an arrow from a
module to every module of the same package it imports: at the top, inside a
function, under ``if TYPE_CHECKING:``, relative or absolute.  A
``TYPE_CHECKING`` import is an arrow like any other: it ties the two modules
together as tightly for the reader, and the way out of it is an interface
(a ``typing.Protocol`` or a zope ``Interface``) at the lower layer.

An arrow goes to the module named: ``from a.b import c`` is an arrow to
``a.b.c`` when that is a module, to ``a.b`` (its ``__init__``) otherwise.
The implicit import of a package's ``__init__`` when one of its modules is
imported is not drawn: ``__init__`` modules that gather their submodules'
names would otherwise put every package in a circle with itself.

Besides the circles between files, ``LAYERS`` names the packages that
stand on one another, lowest first: an arrow from a package to one of its
own layer or a higher one is reported too (the protocols of one layer stand
side by side, none on another), and so is a package that is in no layer.

Usage::

    python tools/importgraph.py [ROOT]        # exit 1 on any circle
    python tools/importgraph.py --edges ROOT  # print the arrows
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

#: the layers of streamproto, lowest first (doc/architecture.rst): a
#: package may import the packages of the layers under its own, never one
#: of its own layer or above it.
LAYERS: Sequence[Sequence[str]] = (
    ("streamproto.base",),
    ("streamproto.log",),
    ("streamproto.core",),
    (
        "streamproto.lumberjack",
        "streamproto.pravega",
        "streamproto.reliable",
        "streamproto.relink",
        "streamproto.styx",
    ),
    ("streamproto.spark",),
    ("streamproto.cli", "streamproto.status", "streamproto.storecli", "streamproto.tap"),
    ("streamproto.__main__",),
)


@dataclass(frozen=True)
class Arrow:
    """
    One import: C{source} imports C{target} at C{line}.
    """

    source: str
    target: str
    line: int


def moduleNames(root: Path) -> dict[str, Path]:
    """
    Every module of the package at C{root} by its dotted name.
    """
    base = root.parent
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _resolveRelative(module: str, isPackage: bool, level: int, name: str | None) -> str:
    """
    The absolute name of C{from <level dots><name> import ...} in C{module}.
    """
    parts = module.split(".")
    if not isPackage:
        parts.pop()
    if level > 1:
        parts = parts[: len(parts) - (level - 1)]
    if name:
        parts.append(name)
    return ".".join(parts)


def _imports(tree: ast.AST, module: str, isPackage: bool) -> Iterator[tuple[str, int]]:
    """
    Every name C{tree} imports, anywhere in it, with its line: a module
    name, or C{package.name} for each name of a C{from} import (which may
    be a module or an attribute: the caller tells them apart).
    """
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _resolveRelative(module, isPackage, node.level, node.module)
            else:
                base = node.module or ""
            yield base, node.lineno
            for alias in node.names:
                if alias.name != "*":
                    yield f"{base}.{alias.name}", node.lineno


def arrows(root: Path) -> list[Arrow]:
    """
    Every arrow between the modules of the package at C{root}.
    """
    modules = moduleNames(root)
    found: set[Arrow] = set()
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        isPackage = path.name == "__init__.py"
        targets: dict[int, set[str]] = {}
        for name, line in _imports(tree, module, isPackage):
            if name in modules:
                targets.setdefault(line, set()).add(name)
        for line, names in targets.items():
            # "from a.b import c": when c is a module, the arrow is to a.b.c
            # alone; a.b is only a target when something else is taken from it
            for name in names:
                if any(other.startswith(name + ".") for other in names):
                    if not _takesAttributes(tree, line, name, modules, module, isPackage):
                        continue
                if name != module:
                    found.add(Arrow(module, name, line))
    return sorted(found, key=lambda a: (a.source, a.target, a.line))


def _takesAttributes(
    tree: ast.AST,
    line: int,
    package: str,
    modules: dict[str, Path],
    module: str,
    isPackage: bool,
) -> bool:
    """
    Whether the C{from package import ...} at C{line} takes a name from
    C{package} that is not one of its modules.
    """
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.lineno == line:
            if node.level:
                base = _resolveRelative(module, isPackage, node.level, node.module)
            else:
                base = node.module or ""
            if base != package:
                continue
            return any(
                alias.name == "*" or f"{base}.{alias.name}" not in modules
                for alias in node.names
            )
    return False


def circles(edges: Iterable[Arrow]) -> list[list[str]]:
    """
    The strongly connected components of more than one module (or a module
    that imports itself): each is one or more circles.
    """
    graph: dict[str, set[str]] = {}
    for arrow in edges:
        graph.setdefault(arrow.source, set()).add(arrow.target)
        graph.setdefault(arrow.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    onStack: set[str] = set()
    components: list[list[str]] = []
    counter = 0

    # Tarjan's algorithm, iteratively (a deep package must not hit the
    # recursion limit)
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        onStack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    onStack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in onStack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        onStack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in graph[node]:
                        components.append(sorted(component))
    return sorted(components)


def _place(module: str, layers: Sequence[Sequence[str]]) -> tuple[int, str] | None:
    """
    The layer and the package of C{module}, or None when no layer names it.
    """
    for level, row in enumerate(layers):
        for package in row:
            if module == package or module.startswith(package + "."):
                return level, package
    return None


def layerViolations(
    edges: Iterable[Arrow], layers: Sequence[Sequence[str]] = LAYERS
) -> list[Arrow]:
    """
    The arrows from a package to one of its own layer or a higher one.
    """
    wrong = []
    for arrow in edges:
        source = _place(arrow.source, layers)
        target = _place(arrow.target, layers)
        if source is None or target is None or source[1] == target[1]:
            continue
        if target[0] >= source[0]:
            wrong.append(arrow)
    return wrong


def unplaced(
    modules: Iterable[str], root: str, layers: Sequence[Sequence[str]] = LAYERS
) -> list[str]:
    """
    The modules of C{root} (other than its own C{__init__}) in no layer.
    """
    return sorted(m for m in modules if m != root and _place(m, layers) is None)


def report(root: Path, layers: Sequence[Sequence[str]] | None = None) -> list[str]:
    """
    One line per problem in the package at C{root}: empty when there are
    no circles and every layer stands where it should.
    """
    if layers is None:
        layers = LAYERS
    edges = arrows(root)
    lines = []
    for component in circles(edges):
        members = set(component)
        inside = sorted(
            f"{a.source}:{a.line} -> {a.target}"
            for a in edges
            if a.source in members and a.target in members
        )
        lines.append("import circle between " + ", ".join(component))
        lines.extend("    " + arrow for arrow in inside)
    for arrow in layerViolations(edges, layers):
        lines.append(
            f"layer turned over: {arrow.source}:{arrow.line} imports {arrow.target}"
        )
    if layers:
        for module in unplaced(moduleNames(root), root.name, layers):
            lines.append(f"in no layer: {module} (tools/importgraph.py LAYERS)")
    return lines


def main(argv: Sequence[str]) -> int:
    args = list(argv)
    showEdges = "--edges" in args
    if showEdges:
        args.remove("--edges")
    root = Path(args[0] if args else "streamproto")
    if showEdges:
        for arrow in arrows(root):
            print(f"{arrow.source}:{arrow.line} -> {arrow.target}")
        return 0
    problems = report(root)
    for line in problems:
        print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
