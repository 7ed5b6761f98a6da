"""The relay's source uses the public API of the libraries it builds on, and its
modules form no import cycle.

A private name of Twisted, Klein, werkzeug or treq (a module, a function, an
attribute such as ``Headers._rawHeaders``) can change in any release without a
deprecation first; the broker would then break in production with no warning.
"""

from __future__ import annotations

import ast
import os
from typing import Dict, Iterator, List, Set, Tuple

import relay
from tests.support import REPO

ROOT = str(REPO)
PACKAGE = os.path.dirname(os.path.abspath(relay.__file__))
LIBRARIES = ("twisted", "klein", "werkzeug", "treq")
# Underscore names of the standard library the relay uses: public API by the
# library's own documentation, or (argparse) the only way to a registered option.
STANDARD = frozenset({
    "_exit",     # os._exit
    "_replace",  # a namedtuple's documented copy-with-changes
    "_actions",  # argparse.ArgumentParser's options, for shell completion
})


def sources() -> Iterator[Tuple[str, ast.Module]]:
    """Every module of the relay package and its twistd and endpoint plugins."""
    paths = [os.path.join(ROOT, "twisted", "plugins", name)
             for name in sorted(os.listdir(os.path.join(ROOT, "twisted", "plugins")))
             if name.endswith(".py")]
    for folder, _, files in os.walk(PACKAGE):
        paths.extend(os.path.join(folder, name) for name in sorted(files)
                     if name.endswith(".py"))
    for path in paths:
        with open(path, encoding="utf-8") as f:
            yield os.path.relpath(path, ROOT), ast.parse(f.read(), path)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def own_names() -> Set[str]:
    """The underscore names the relay defines itself (functions, classes,
    attributes it assigns, class attributes, module globals)."""
    names: Set[str] = set()
    for _, tree in sources():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return {name for name in names if _private(name)}


def private_uses() -> List[str]:
    """``path:line name`` for each private name of a library the relay uses."""
    ours = own_names()
    found = []
    for path, tree in sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                parts = node.module.split(".")
                if parts[0] in LIBRARIES:
                    private = [p for p in parts if _private(p)]
                    private += [a.name for a in node.names if _private(a.name)]
                    if private:
                        found.append(f"{path}:{node.lineno} {node.module}: {private}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] in LIBRARIES and any(_private(p) for p in parts):
                        found.append(f"{path}:{node.lineno} {alias.name}")
            elif (isinstance(node, ast.Attribute) and _private(node.attr)
                  and node.attr not in ours and node.attr not in STANDARD):
                found.append(f"{path}:{node.lineno} .{node.attr}")
    return found


def test_the_relay_uses_no_private_name_of_twisted_klein_werkzeug_or_treq() -> None:
    assert private_uses() == []


def test_the_check_finds_a_private_name() -> None:
    tree = ast.parse("from twisted.web.http_headers import _nameEncoder\n"
                     "headers._rawHeaders.get(name)\n")
    names = {getattr(n, "attr", None) for n in ast.walk(tree)}
    assert "_rawHeaders" in names and "_rawHeaders" not in own_names()


def test_production_code_imports_no_testing_helper_of_twisted() -> None:
    offenders = []
    for path, tree in sources():
        if path.endswith(os.path.join("relay", "testing.py")):
            continue  # the test support shipped with the package
        for node in ast.walk(tree):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            if module in ("twisted.internet.testing", "twisted.trial.unittest",
                          "twisted.test.proto_helpers") or (
                    module or "").startswith("twisted.test"):
                offenders.append(f"{path}:{node.lineno} {module}")
    assert offenders == []


def import_graph() -> Dict[str, Set[str]]:
    """relay module -> the relay modules it imports, at any depth of its code."""
    graph: Dict[str, Set[str]] = {}
    for path, tree in sources():
        if not path.startswith("relay" + os.sep):
            continue
        module = path[:-3].replace(os.sep, ".")
        if module.endswith(".__init__"):
            module = module[: -len(".__init__")]
        package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
        targets = graph.setdefault(module, set())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.startswith("relay"))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                if base.startswith("relay"):
                    targets.add(base)
                    targets.update(f"{base}.{a.name}" for a in node.names)
    modules = set(graph)
    return {m: {t for t in ts if t in modules and t != m} for m, ts in graph.items()}


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The import cycles of ``graph`` (one path each)."""
    found: List[List[str]] = []
    state: Dict[str, int] = {}
    stack: List[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                found.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_no_module_of_the_relay_imports_one_that_imports_it() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
