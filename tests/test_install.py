"""`make install`'s torch: the Makefile keeps a torch already in the venv only where it meets pyproject.toml's floor,
else it installs its pinned TORCH_SPEC first (pip's resolver would otherwise meet the floor with the multi-GB CUDA
build). The two must name the same floor, and the pin must meet it."""

from __future__ import annotations

import re

import pytest
from packaging.requirements import Requirement

from testkit import REPO

tomllib = pytest.importorskip("tomllib")  # Python 3.11+


def test_the_makefiles_torch_check_is_pyprojects_floor():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    [torch] = [r for r in map(Requirement, pyproject["project"]["dependencies"]) if r.name == "torch"]
    [floor] = [s.version for s in torch.specifier if s.operator == ">="]
    makefile = (REPO / "Makefile").read_text()
    [checked] = re.findall(r"torch\.__version__\.split\('\.'\)\[:2\]\)\) < \((\d+), (\d+)\)", makefile)
    assert ".".join(checked) == floor, (checked, str(torch))
    [pin] = re.findall(r"^TORCH_SPEC \?= (\S+)$", makefile, re.MULTILINE)
    pinned = Requirement(pin)
    assert pinned.name == "torch" and all(torch.specifier.contains(s.version) for s in pinned.specifier), pin
