"""Every package's README and CHANGELOG have the same shape, so a new package copies it.

README: the sections `What it is`, `Install`, `Use`, `Figures` (naming the command that
reproduced them) and `Limits`, in that order (other sections may sit between them).
CHANGELOG: Keep a Changelog headings (`## [Unreleased]`, `## [X.Y.Z] - YYYY-MM-DD`, and
`### Added/Changed/...` above every entry).
"""

from __future__ import annotations

import re
import tomllib

import catalog
import pytest

README_SECTIONS = ("What it is", "Install", "Use", "Figures", "Limits")
CHANGE_KINDS = ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security")
RELEASE = re.compile(r"^## \[(Unreleased|\d+\.\d+\.\d+)\]( - \d{4}-\d{2}-\d{2})?$")
COMMAND = re.compile(r"`(spore|python|nox|pytest) [^`]+`")


def _packages() -> dict[str, str]:
    """Distribution name -> folder, for the core and every catalog package."""
    core = tomllib.loads((catalog.ROOT / "core/pyproject.toml").read_text())["project"]["name"]
    return {core: "core"} | {e.distribution: e.path for e in catalog.load()}


def _lines(text: str) -> list[tuple[str, bool]]:
    """Each line of a Markdown text and whether it sits inside a fenced code block."""
    lines, fenced = [], False
    for line in text.splitlines():
        fence = line.startswith("```")
        fenced ^= fence
        lines.append((line, fenced or fence))
    return lines


def _headings(text: str, prefix: str) -> list[tuple[int, str]]:
    """(index, line) of every line outside code that starts with ``prefix``."""
    return [
        (i, line)
        for i, (line, code) in enumerate(_lines(text))
        if not code and line.startswith(prefix)
    ]


def readme_problems(text: str) -> list[str]:
    """What keeps a package README from the shared section order (empty: it follows it)."""
    sections = _headings(text, "## ")
    required = [line[3:] for _, line in sections if line[3:] in README_SECTIONS]
    problems = []
    if required != list(README_SECTIONS):
        problems.append(
            f"sections {required} must be exactly {list(README_SECTIONS)} in this order "
            "(as '## ' headings; other sections may sit between them)"
        )
    starts = [i for i, _ in sections] + [len(text.splitlines())]
    for n, (i, line) in enumerate(sections):
        body = "\n".join(text.splitlines()[i + 1 : starts[n + 1]])
        if line == "## Figures" and not COMMAND.search(body):
            problems.append("## Figures names no command that reproduces them (`spore ...`)")
    return problems


def changelog_problems(text: str, distribution: str) -> list[str]:
    """What keeps a CHANGELOG from the Keep a Changelog heading style (empty: it follows it)."""
    problems = []
    if text.split("\n", 1)[0] != f"# Changelog: {distribution}":
        problems.append(f"the first line must be '# Changelog: {distribution}'")
    release = kind = None
    for number, (line, code) in enumerate(_lines(text), 1):
        if code:
            continue
        if line.startswith("## "):
            if not RELEASE.match(line):
                problems.append(
                    f"line {number}: {line!r} must be '## [Unreleased]' or "
                    "'## [X.Y.Z] - YYYY-MM-DD'"
                )
            elif ("Unreleased" in line) == (" - " in line):
                problems.append(f"line {number}: only a released version carries a date")
            release, kind = line, None
        elif line.startswith("### "):
            kind = line[4:]
            if kind not in CHANGE_KINDS or release is None:
                problems.append(f"line {number}: {line!r} must be one of {CHANGE_KINDS}")
        elif line.startswith("- ") and kind is None:
            problems.append(f"line {number}: entry outside a '### <kind>' section")
    if release is None:
        problems.append("no '## [Unreleased]' or '## [X.Y.Z] - YYYY-MM-DD' section")
    return problems


@pytest.mark.parametrize("distribution", sorted(_packages()))
def test_every_package_readme_has_the_shared_sections(distribution: str) -> None:
    path = catalog.ROOT / _packages()[distribution] / "README.md"
    assert readme_problems(path.read_text()) == [], path


@pytest.mark.parametrize("distribution", sorted(_packages()))
def test_every_package_changelog_follows_keep_a_changelog(distribution: str) -> None:
    path = catalog.ROOT / _packages()[distribution] / "CHANGELOG.md"
    assert changelog_problems(path.read_text(), distribution) == [], path


def test_readme_check_names_what_is_missing_or_out_of_order() -> None:
    good = (
        "# x\n## What it is\n## Install\n## Use\n## Tests\n## Figures\n`spore bench x`\n## Limits\n"
    )
    assert readme_problems(good) == []
    swapped = good.replace("## Use\n", "").replace("## Limits\n", "## Limits\n## Use\n")
    assert "in this order" in readme_problems(swapped)[0]
    fenced = good.replace("## Install\n", "```\n## Install\n```\n")
    assert "in this order" in readme_problems(fenced)[0]
    assert "names no command" in readme_problems(good.replace("`spore bench x`", "fast"))[0]


def test_changelog_check_names_each_bad_heading() -> None:
    good = "# Changelog: demo\n\n## [Unreleased]\n\n### Fixed\n\n- a\n\n## [0.1.0] - 2026-11-30\n"
    assert changelog_problems(good, "demo") == []
    assert changelog_problems(good, "other") == ["the first line must be '# Changelog: other'"]
    bad = good.replace("## [0.1.0] - 2026-11-30", "## 0.1.0 (unreleased)")
    assert "must be '## [Unreleased]'" in changelog_problems(bad, "demo")[0]
    assert (
        "carries a date"
        in changelog_problems(good.replace("]\n", "] - 2026-01-01\n", 1), "demo")[0]
    )
    assert "must be one of" in changelog_problems(good.replace("Fixed", "Misc"), "demo")[0]
    assert "outside a" in changelog_problems(good.replace("### Fixed\n", ""), "demo")[0]
