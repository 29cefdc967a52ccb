"""The docs' links and the README's figures, read from the files (nothing is imported or run): every relative link in
README.md, docs/*.md, BENCHMARKS.md and benchmarks/results/history/*.md names a file that exists, and a link with an
`#anchor` into a .md file names one of its headings (GitHub's slug of it); every figure in the README's comparison
table (a number with a decimal point or a unit: 1.40, 1.02-1.13x, 40.1-41.1k, 5.75 GiB) is written as it stands in
BENCHMARKS.md, the one place figures are kept. Links inside code blocks and code spans are not links."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.+?)[ \t#]*$", re.M)
# a number, a range of two, with a unit or not: 1.40, 1.02-1.13x, 40.1-41.1k, 2.7M, 0.2%, 5.75 GiB, 32768; not the 2.5
# of Qwen2.5 nor the 1.5 of 1.5B (names). `figures` keeps those with a decimal point or a unit.
FIGURE = re.compile(r"(?<![\w.,-])\d[\d,]*(?:\.\d+)?(?:-\d[\d,]*(?:\.\d+)?)?(?:[xkM%]| [KMG]iB)?(?![\w%])(?![.,]\d)")


def docs(root: Path) -> list[Path]:
    """The Markdown files whose links are checked."""
    return [
        root / "README.md",
        root / "BENCHMARKS.md",
        *sorted((root / "docs").glob("*.md")),
        *sorted((root / "benchmarks" / "results" / "history").glob("*.md")),
    ]


def prose(text: str) -> str:
    """The text without fenced code blocks and code spans (what is in them is shown, not linked)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text (a link's text, no markup) lowercased, every character but letters,
    digits, '_', '-' and spaces dropped, each space a '-'."""
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)", r"\1", heading)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a Markdown file's headings; a repeated slug gets -1, -2, ... as GitHub numbers them."""
    seen: dict[str, int] = {}
    found = set()
    for match in HEADING.finditer(FENCE.sub("", text)):
        base = slug(match.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def broken_links(paths: list[Path], root: Path) -> list[str]:
    """'file:line: target (why)' for each relative link that names no file, or no heading of a .md file."""
    bad = []
    for path in paths:
        text = path.read_text()
        for match in LINK.finditer(prose(text)):
            target = match.group(1)
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
                continue
            where = f"{path.relative_to(root)}: {target}"
            name, _, anchor = target.partition("#")
            file = (path.parent / name).resolve() if name else path
            if not file.exists():
                bad.append(f"{where} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
                bad.append(f"{where} (no heading with this anchor in {file.relative_to(root)})")
    return bad


def table_after(text: str, heading: str) -> list[str]:
    """The body rows of the first table under a heading (its header and separator left out)."""
    section = text.split(heading, 1)[1]
    rows = []
    for line in section.splitlines():
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            break
    return rows[2:]


def figures(line: str) -> list[str]:
    """The figures written in a line of prose or a table row: numbers with a decimal point or a unit."""
    found = (m.group(0) for m in FIGURE.finditer(prose(line)))
    return [f for f in found if "." in f or not f[-1].isdigit()]


def written_in(figure: str, text: str) -> bool:
    """Whether a figure stands in a text as a figure of its own (not as part of a longer one), bold or not."""
    plain = text.replace("**", "")
    return re.search(rf"(?<![\w.,-]){re.escape(figure)}(?![\w%])(?![.,]\d)", plain) is not None


def test_the_reader_finds_links_anchors_and_figures(tmp_path):
    """A made-up tree: links to a file, to a heading of another file and of the same one, a repeated heading, a
    link inside a code block and a span (not links), one to a missing file and one to a missing heading."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "BENCHMARKS.md").write_text(
        "# Benchmarks\n\n## Where the 7B forward's time goes (2026-12-03, issue 41)\n\n## `LogProbWorker.score`\n\n"
        "### Runs\n\n### Runs\n\nSee [the runs](#runs-1) and [the score](#logprobworkerscore).\n"
    )
    (tmp_path / "README.md").write_text(
        "[a](BENCHMARKS.md#where-the-7b-forwards-time-goes-2026-12-03-issue-41) [b](docs/missing.md) "
        "[c](BENCHMARKS.md#runs-2) [d](https://example.com/x.md) `[e](nowhere.md)`\n\n```\n[f](nowhere.md)\n```\n"
        "| you | it | we |\n|---|---|---|\n| Qwen2.5-1.5B | 74.2 GiB at 32768 | 1.791 -> 1.397 s, 1.02-1.13x, 23.0k |\n"
    )
    assert broken_links(docs(tmp_path), tmp_path) == [
        "README.md: docs/missing.md (no such file)",
        "README.md: BENCHMARKS.md#runs-2 (no heading with this anchor in BENCHMARKS.md)",
    ]
    row = (tmp_path / "README.md").read_text().splitlines()[-1]
    assert figures(row) == ["74.2 GiB", "1.791", "1.397", "1.02-1.13x", "23.0k"]
    assert written_in("1.02-1.13x", "gives **1.02-1.13x** here") and not written_in("1.13x", "1.02-1.13x")
    assert not written_in("23.0k", "123.0k") and not written_in("1.5", "1.5.2")


def test_relative_links_name_files_and_headings_that_exist():
    assert broken_links(docs(ROOT), ROOT) == []


def test_the_readme_tables_figures_are_written_in_benchmarks():
    """The README's comparison table quotes BENCHMARKS.md; each of its figures stands there as written."""
    rows = table_after((ROOT / "README.md").read_text(), "## When to use it")
    found = [f for row in rows for f in figures(row)]
    assert len(found) >= 5, rows  # the table is there and quotes figures
    benchmarks = (ROOT / "BENCHMARKS.md").read_text()
    assert [f for f in found if not written_in(f, benchmarks)] == []
