"""The user-facing pages link to files and sections that exist: every relative markdown link in README.md,
BENCHMARKS.md and docs/*.md names a file in the repository, and its #anchor a heading of that file, as GitHub
renders it (lowercase, spaces to '-', punctuation dropped, repeats numbered -1, -2, ...)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from testkit import REPO

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")
# [text](target) or ![alt](target); the text may run over a line break, as the README's wrapped prose has it
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


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
