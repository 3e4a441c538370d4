"""No dead code: every top-level function, class and constant of a product module is used by the product.

A name that only the tests use is dead code (the tests would be testing something no run does). Used means read in
its own module (outside its own definition), imported from it by name, or read as an attribute anywhere (a module
used as an object: evals.runner's TASKS[task].requests) or named in a string (getattr, __all__)."""

from __future__ import annotations

import ast
from pathlib import Path

from testkit import REPO, product_modules


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def defined(tree: ast.Module) -> list[tuple[str, ast.stmt]]:
    """(name, definition) of each top-level function, class and assigned name."""
    found = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.append((node.name, node))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found += [(t.id, node) for t in targets if isinstance(t, ast.Name)]
    return found


def test_every_top_level_name_is_used_by_the_product():
    trees = {path: ast.parse(path.read_text(), filename=str(path)) for path in product_modules()}
    attributes, imported = set(), set()  # attribute names read anywhere; (module, name) imported by name
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                attributes.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                attributes.add(node.value)
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported |= {(node.module, alias.name) for alias in node.names}
    unused = []
    for path, tree in trees.items():
        module = module_name(path)
        for name, definition in defined(tree):
            if name.startswith("__") or name in attributes or (module, name) in imported:
                continue
            inside = {id(node) for node in ast.walk(definition)}
            reads = [node for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)]
            read_here = any(node.id == name and id(node) not in inside for node in reads)
            if not read_here:
                unused.append(f"{path.relative_to(REPO)}:{definition.lineno} {name}")
    assert len(trees) > 40  # the walk found the project
    assert not unused, "defined but used by no product module (remove it, or use it):\n" + "\n".join(unused)
