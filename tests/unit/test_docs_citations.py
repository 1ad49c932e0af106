"""Every citation of the manual resolves: a ``docs/<file>.md §<Section>`` in code, config or docs
names a heading of that file, and a Markdown link ``<file>.md#<anchor>`` an anchor of it
(GitHub's heading slugs). A renamed or removed heading fails here, not in a reader's hands."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CITATION = re.compile(r"((?:docs/)?[A-Za-z0-9_-]+\.md) §")
LINK = re.compile(r"\]\(((?:\.\./|docs/)?[A-Za-z0-9_-]+\.md)#([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.M)
CONTINUATION = re.compile(r"^\s*(?:#+:?|\*|//|--|>)?\s*")


def headings(doc: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.S | re.M)   # not in code blocks
    return [h.strip() for h in HEADING.findall(text)]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    return [ROOT / f for f in out
            if f.endswith((".py", ".md", ".yaml", ".yml", ".toml", ".conf", ".sh", ".txt"))
            or f.endswith("Makefile")]


def resolve(doc_name: str, source: Path) -> Path | None:
    name = doc_name.removeprefix("../")
    for candidate in (ROOT / name, ROOT / "docs" / name, source.parent / name):
        if candidate.is_file():
            return candidate
    return None


def cited(text: str, start: int) -> str:
    """The words after ``§`` at ``start``, with the next line's when the citation wraps."""
    line_end = text.find("\n", start)
    line_end = len(text) if line_end < 0 else line_end
    following = text[line_end + 1:text.find("\n", line_end + 1) if "\n" in text[line_end + 1:]
                     else len(text)]
    return (text[start:line_end] + " " + CONTINUATION.sub("", following, count=1)).strip()


def names_section(words: str, heading: str) -> bool:
    """``words`` (what follows ``§``) name ``heading``: they start with the whole heading, or
    the citation's own words (up to its first ``)``, ``,``, ``;`` or ``.``) start it."""
    heading = re.sub(r"[`*]", "", heading).lower()
    words = words.lower()

    def starts(text: str, prefix: str) -> bool:
        return text.startswith(prefix) and (len(text) == len(prefix) or
                                            not text[len(prefix)].isalnum())
    short = re.split(r"[),;.]| says| recommends|'s ", words, maxsplit=1)[0].strip()
    return starts(words, heading) or (bool(short) and starts(heading, short))


def citations():
    for source in tracked():
        if not source.is_file():
            continue
        text = source.read_text(errors="replace")
        for m in CITATION.finditer(text):
            yield source, m.group(1), cited(text, m.end())
        for m in LINK.finditer(text):
            yield source, m.group(1), "#" + m.group(2)


def test_every_cited_section_is_a_heading_of_its_file():
    broken = []
    for source, doc_name, words in citations():
        doc = resolve(doc_name, source)
        if doc is None:          # another project's file (the spec's, Hermes's): not ours to check
            if doc_name.startswith("docs/"):
                broken.append(f"{source.relative_to(ROOT)}: {doc_name} does not exist")
            continue
        names = headings(doc)
        if words.startswith("#"):
            if words[1:] not in {slug(h) for h in names}:
                broken.append(f"{source.relative_to(ROOT)}: {doc_name}{words}")
            continue
        if not any(names_section(words, h) for h in names):
            broken.append(f"{source.relative_to(ROOT)}: {doc_name} §{words[:60]}")
    assert not broken, "citations without a heading:\n" + "\n".join(sorted(set(broken)))


@pytest.mark.parametrize("heading, anchor", [
    ("Process lifetime", "process-lifetime"), ("`Last-Event-ID` and reconnects",
                                               "last-event-id-and-reconnects"),
    ("Runs and their events", "runs-and-their-events")])
def test_slug_is_githubs(heading, anchor):
    assert slug(heading) == anchor
