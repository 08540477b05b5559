"""Every relative link and image in README.md and docs/*.md points at a file of the repository, and
every #anchor at a heading of that file (GitHub's slugs), so moving a section cannot strand a link."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", ROOT / "k8s" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")


def prose_lines(markdown: str) -> list[str]:
    """The lines outside fenced code blocks: a `# comment` in a bash block is no heading."""
    lines, in_code = [], False
    for line in markdown.splitlines():
        if FENCE.match(line):
            in_code = not in_code
        elif not in_code:
            lines.append(line)
    return lines


def heading_slugs(markdown: str) -> set[str]:
    """GitHub's anchors: lower case, punctuation (backticks too) dropped, spaces to hyphens."""
    headings = (re.sub(r"^#+\s+", "", line).strip() for line in prose_lines(markdown) if re.match(r"^#+\s", line))
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def broken_links(document: Path) -> list[str]:
    broken = []
    for line in prose_lines(document.read_text()):
        for target in LINK.findall(line):
            if re.match(r"^[a-z]+:", target):  # https:, mailto:: not ours to check offline
                continue
            path, _, anchor = target.partition("#")
            file = (document.parent / path).resolve() if path else document
            if not file.exists():
                broken.append(f"{target}: no file {file}")
            elif anchor and file.suffix == ".md" and anchor not in heading_slugs(file.read_text()):
                broken.append(f"{target}: no heading #{anchor} in {file.name}")
    return broken


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(document):
    assert broken_links(document) == []


def test_the_checker_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## A `code` heading (with punctuation)\n")
    doc = tmp_path / "doc.md"
    doc.write_text("[ok](other.md#a-code-heading-with-punctuation) ![img](gone.png) [bad](other.md#nowhere)\n"
                   "[web](https://example.com/x) [self](#top)\n\n# Top\n```bash\n[not a link](nowhere.md)\n```\n")
    assert broken_links(doc) == [f"gone.png: no file {tmp_path / 'gone.png'}",
                                 "other.md#nowhere: no heading #nowhere in other.md"]


# A pasted patch or an unresolved merge: hunk headers ("@@ -694,18 +754,21 @@", also with one "@"
# lost) and conflict markers.
LEFTOVER = re.compile(r"^(@@? -\d+(,\d+)? \+\d+(,\d+)? @@?|<{7}( |$)|={7}$|>{7}( |$))")


def leftovers(markdown: str) -> list[str]:
    """What a document must not hold: diff or merge markers, and a code fence left open (the rest of
    the page would render as code, and the link check would skip it)."""
    found = [f"line {number}: {line[:60]}" for number, line in enumerate(markdown.splitlines(), 1)
             if LEFTOVER.match(line)]
    fences = [number for number, line in enumerate(markdown.splitlines(), 1) if FENCE.match(line)]
    if len(fences) % 2:
        found.append(f"line {fences[-1]}: a code fence is never closed")
    return found


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_document_holds_patch_or_merge_markers_or_an_open_fence(document):
    assert leftovers(document.read_text()) == []


def test_the_leftover_check_finds_a_hunk_a_conflict_and_an_open_fence():
    pasted = (
        "# Doc\n\n```bash\n@ -694,18 +754,21 @@ the resume itself\n<<<<<<< HEAD\nours\n=======\ntheirs\n>>>>>>> b\n"
    )
    assert leftovers(pasted) == [
        "line 4: @ -694,18 +754,21 @@ the resume itself",
        "line 5: <<<<<<< HEAD",
        "line 7: =======",
        "line 9: >>>>>>> b",
        "line 3: a code fence is never closed",
    ]
    assert leftovers("# Doc\n\n```\ncode\n```\n\nText with a=b and @ -1 in prose.\n") == []


REPO_PATH = re.compile(r"`((?:trainer|data_pipeline|tests|k8s|configs|ds_configs|docs)/[\w/.\-]+?\.(?:py|yaml|json|md))"
                       r"(?::\w+)?`")


def missing_paths(document: Path) -> list[str]:
    """Repository files a document names in backticks (`trainer/engine/trainer.py`) that do not exist."""
    return [path for path in REPO_PATH.findall(document.read_text()) if not (ROOT / path).exists()]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_a_document_names_exists(document):
    assert missing_paths(document) == []


def test_the_path_check_finds_a_moved_file(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("See `trainer/engine/trainer.py` and `trainer/engine/checkpoint.py:save_checkpoint`.\n")
    assert missing_paths(doc) == ["trainer/engine/checkpoint.py"]
