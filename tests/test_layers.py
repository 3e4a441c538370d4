"""Layers import downwards only: modeling < data_prep < evals < training < train_accel.py and bench/.

Every import statement of every module counts, those inside functions included (a lazy import is still a
dependency)."""

from __future__ import annotations

import ast

from testkit import LAYERS, REPO, product_modules


def imported_layers(path) -> list[tuple[int, str]]:
    """(line, top-level project package) of each import in the file at `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [(node.lineno, name.split(".")[0]) for name in names if name.split(".")[0] in LAYERS]
    return found


def test_every_module_imports_only_its_own_layer_or_lower():
    modules = product_modules()
    assert len(modules) > 40  # the walk found the project
    upward = []
    for path in modules:
        rel = path.relative_to(REPO)
        own = LAYERS[rel.parts[0].removesuffix(".py")]
        upward += [f"{rel}:{line} imports {name}" for line, name in imported_layers(path) if LAYERS[name] > own]
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)
