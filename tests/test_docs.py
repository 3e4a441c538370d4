"""The user-facing pages link to files and sections that exist: every relative markdown link in README.md,
BENCHMARKS.md and docs/*.md names a file in the repository, and its #anchor a heading of that file, as GitHub
renders it (lowercase, spaces to '-', punctuation dropped, repeats numbered -1, -2, ...). And the commands that
README.md and docs/*.md give users take the flags they show: each `--flag` given to train_accel.py or a
`python -m` entry point is one its --help lists."""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import shlex
from collections import Counter
from functools import cache
from pathlib import Path

from testkit import REPO
from training.config import build_parser

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")
# [text](target) or ![alt](target); the text may run over a line break, as the README's wrapped prose has it
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# the entry points whose flags the pages' commands are checked against (`python -m MODULE`, or train_accel.py)
ENTRY_POINTS = (
    "train_accel.py", "bench.attention_speed", "bench.ladder", "bench.time_to_loss", "data_prep.bench",
    "data_prep.prepare", "evals", "evals.bench", "evals.data", "evals.generate", "training.export", "training.hub",
    "training.memory_table", "training.pick_cpu_config",
)  # fmt: skip
# where one command's arguments end: another entry point, `-m` (python -m training.launch ... -m evals), the shell's
END = {"python", "train_accel.py", "-m", "&&", "||", "|", ";"}


def pages() -> list[Path]:
    return [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").glob("*.md"))]


def prose(text: str) -> list[str]:
    """The lines outside fenced code blocks (a `# comment` in a bash block is no heading, a link there no link)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            lines.append("")
        else:
            lines.append("" if fenced else line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: of its rendered text (link text kept, code marks dropped), lowercase, every
    character but letters, digits, '_', '-' and spaces dropped, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: Counter[str] = Counter()
    found = set()
    for line in prose(path.read_text()):
        if match := HEADING.match(line):
            base = slug(match.group(1))
            found.add(f"{base}-{seen[base]}" if seen[base] else base)
            seen[base] += 1
    return found


def broken_links(path: Path, root: Path = REPO) -> list[str]:
    """'page:line: target (why)' for each relative link of the page at `path` that does not resolve (paths named
    from `root`)."""
    lines = prose(path.read_text())
    text = "\n".join(re.sub(r"`[^`]*`", lambda m: " " * len(m.group()), line) for line in lines)  # code spans
    broken = []
    for match in LINK.finditer(text):
        target = match.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        where = f"{path.relative_to(root)}:{text.count(chr(10), 0, match.start()) + 1}: {target}"
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{where} (no file {file_part})")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{where} (no heading #{anchor} in {linked.relative_to(root)})")
    return broken


def test_slugs_follow_githubs_rules():
    assert slug("The model's shape") == "the-models-shape"
    assert slug("Time to loss (`python -m bench.time_to_loss`)") == "time-to-loss-python--m-benchtime_to_loss"
    assert slug("The test suite's time (`make test`)") == "the-test-suites-time-make-test"
    assert slug("Push to the 🤗 Hub") == "push-to-the--hub"


def test_a_missing_file_and_a_missing_heading_are_found(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n\n```bash\n# not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\nSee [the section](other.md#a-section), [this page](#page), [a\nwrapped one](other.md#other-page)"
        " and `[code](nowhere.md)`.\n\nBroken: [gone](gone.md), [no such](other.md#not-a-heading), "
        "[comment](other.md#not-a-heading-1) and [here](#nothing).\n"
    )
    found = [line.split(": ", 1)[1] for line in broken_links(page, tmp_path)]
    assert found == [
        "gone.md (no file gone.md)",
        "other.md#not-a-heading (no heading #not-a-heading in other.md)",
        "other.md#not-a-heading-1 (no heading #not-a-heading-1 in other.md)",
        "#nothing (no heading #nothing in page.md)",
    ]


def test_every_relative_link_resolves():
    assert {"README.md", "BENCHMARKS.md"} <= {page.name for page in pages()}
    broken = [line for page in pages() for line in broken_links(page)]
    assert not broken, "links that do not resolve:\n" + "\n".join(broken)


def commands(text: str) -> list[tuple[int, str]]:
    """(line, command) for each line of the page's fenced blocks (a trailing backslash joining the next, a `#`
    comment dropped) and each inline code span outside them."""
    found, fenced, held, start = [], False, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif fenced:
            start = start or number
            held += re.sub(r"(^|\s)#.*", "", line)
            if held.rstrip().endswith("\\"):
                held = held.rstrip()[:-1] + " "
                continue
            found.append((start, held))
            held, start = "", 0
        else:
            found += [(number, span) for span in re.findall(r"`([^`]+)`", line)]
    return found


@cache
def flags_of(entry_point: str) -> frozenset[str]:
    """The flags the entry point's --help lists (train_accel.py's: TrainConfig's parser's)."""
    if entry_point == "train_accel.py":
        text = build_parser().format_help()
    else:
        module = importlib.import_module("evals.__main__" if entry_point == "evals" else entry_point)
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            module.main(["--help"])
        text = out.getvalue()
    return frozenset(re.findall(r"--[a-z0-9][a-z0-9-]*", text))


def unknown_flags(path: Path, root: Path = REPO) -> list[str]:
    """'page:line: ENTRY has no --flag' for each flag a command of the page gives an entry point that lacks it
    (a quoted argument, e.g. bench.time_to_loss's --set "--lr 3e-3", is one value, not flags)."""
    unknown = []
    for number, command in commands(path.read_text()):
        try:
            words = shlex.split(command)
        except ValueError:  # a span that is not a whole command, e.g. an unclosed quote
            words = command.split()
        entry = None
        for i, word in enumerate(words):
            if word in END or (i and words[i - 1] == "-m"):
                entry = word if word == "train_accel.py" or (words[i - 1] == "-m" and word in ENTRY_POINTS) else None
            elif entry and (flag := re.fullmatch(r"\[?(--[a-z0-9][a-z0-9_-]*)(=\S*)?\]?", word)):
                # TrainConfig's flags take '_' for '-' too (--micro_batch_size 8)
                name = flag.group(1).replace("_", "-") if entry == "train_accel.py" else flag.group(1)
                if name not in flags_of(entry):
                    unknown.append(f"{path.relative_to(root)}:{number}: {entry} has no {flag.group(1)}")
    return unknown


def test_a_flag_an_entry_point_lacks_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "Run `python -m evals --run RUN --limt 5` or\n\n```bash\npython train_accel.py --micro_batch_size 8 \\\n"
        '    --max-step 3   # --not-a-flag in a comment\npython -m bench.time_to_loss --set "--lr 3e-3" --seed 1\n'
        "python -m training.launch -q --config_file X.yaml -m evals.generate --run RUN [--tokens 5]\n"
        'make train ARGS="--resume never"\n```\n'
    )
    assert unknown_flags(page, tmp_path) == [
        "page.md:1: evals has no --limt",
        "page.md:4: train_accel.py has no --max-step",
        "page.md:6: bench.time_to_loss has no --seed",
        "page.md:7: evals.generate has no --tokens",
    ]


def test_every_flag_the_pages_give_an_entry_point_exists():
    unknown = [line for page in pages() if page.name != "BENCHMARKS.md" for line in unknown_flags(page)]
    assert not unknown, "flags the entry points do not take:\n" + "\n".join(unknown)
