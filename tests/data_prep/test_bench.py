"""python -m data_prep.bench's tables and bad input: the CPU named as the other benchmarks name it, small libraries
told apart and named alike in both tables, and a size or scratch folder it cannot use as argparse's one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from data_prep.bench import main
from modeling.device import cpu_model


def test_a_small_library_is_named_by_its_size_and_the_cpu_by_its_model(tmp_path: Path, capsys):
    """The header named the CPU 'x86_64' (platform.processor()), the library column read '0M' for every library
    under 0.5M tokens, and the loader's table named the size asked for, not the one built (a book at least)."""
    main(["--tokens", "1e4", "--work", str(tmp_path)])
    out = capsys.readouterr().out
    assert f"Data preparation, CPU: {cpu_model()}, files:" in out
    rows = [line for line in out.splitlines() if line.startswith("| 0.")]
    sizes = {row.split(" |")[0].split()[1] for row in rows}
    assert len(rows) == 3 and sizes == {"0.12M"}, rows  # prepare at 1 and 2 processes, then the loader


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--tokens", "-5"], "argument --tokens: must be at least 1, got -5"),
        (["--tokens", "ten"], "argument --tokens: expected a number of tokens such as 50e6, got 'ten'"),
        (["--work", "{file}"], "--work {file}: a file is there; give a scratch folder"),
    ],
)
def test_bad_input_is_argparses_line_before_any_library_is_built(tmp_path: Path, capsys, argv: list[str], why: str):
    """--tokens -5 was a FileNotFoundError traceback, and a --work that is a file mkdir's NotADirectoryError."""
    file = tmp_path / "scratch"
    file.write_text("a file where the scratch folder goes")
    with pytest.raises(SystemExit) as exc:
        main(["--tokens", "1e4", "--work", str(tmp_path / "work"), *[a.format(file=file) for a in argv]])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"error: {why.format(file=file)}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scratch"]  # nothing built
