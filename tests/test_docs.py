"""The docs stay true: every public name is in the API reference, every link and path resolves.

Public names are the ``__all__`` of the package's faces: ``adaptive`` and
every public subpackage (``adaptive.elastic``, ``adaptive.data.tokens``,
...; those starting with ``_`` are internal). Each face has a section
``## `adaptive.X` `` in docs/api.md that must mention each of its names in a
code span.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import adaptive

REPO = Path(__file__).resolve().parent.parent
API = REPO / "docs" / "api.md"
MARKDOWN = sorted([REPO / "README.md", REPO / "examples" / "README.md", *(REPO / "docs").glob("*.md")])

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$", re.MULTILINE)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def public_modules() -> list[str]:
    """Every public subpackage (face) below ``adaptive`` that declares ``__all__``, found recursively.

    Plain modules are implementation, not faces; a package or module whose
    name starts with ``_`` is internal, and so is everything below it.
    """
    names = []

    def walk(package) -> None:
        for info in pkgutil.iter_modules(package.__path__):
            if not info.ispkg or info.name.startswith("_"):
                continue
            sub = importlib.import_module(f"{package.__name__}.{info.name}")
            if hasattr(sub, "__all__"):
                names.append(sub.__name__)
            walk(sub)

    walk(adaptive)
    return sorted(names)


def api_sections() -> dict[str, str]:
    """Text of each ``## `module` ...`` section of docs/api.md, keyed by module name."""
    text = API.read_text(encoding="utf-8")
    sections, matches = {}, list(re.finditer(r"^## `([\w.]+)`.*$", text, re.MULTILINE))
    for match, following in zip(matches, matches[1:] + [None]):
        end = following.start() if following else len(text)
        sections[match.group(1)] = text[match.end():end]
    return sections


def mentioned_in_code(name: str, text: str) -> bool:
    """``name`` as a whole word inside some `code span` (or code block) of ``text``."""
    pattern = re.compile(rf"(?<![\w.]){re.escape(name)}(?!\w)")
    spans = re.findall(r"`([^`\n]+)`", FENCE.sub("", text)) + FENCE.findall(text)
    return any(pattern.search(span) for span in spans)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return {slug(match.group(2)) for match in HEADING.finditer(text)}


def links(path: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", path.read_text(encoding="utf-8")))


def test_the_faces_are_found():
    faces = public_modules()
    assert {"adaptive.elastic", "adaptive.checkpoint", "adaptive.data", "adaptive.data.tokens",
            "adaptive.batchsize", "adaptive.observe", "adaptive.parallel"} <= set(faces), faces
    assert not any("._" in face for face in faces), faces


def test_every_top_level_name_is_in_the_api_reference():
    top = api_sections()["adaptive"]
    missing = [name for name in adaptive.__all__ if not mentioned_in_code(name, top)]
    assert not missing, f"docs/api.md's `adaptive` section does not mention {missing}"


@pytest.mark.parametrize("module", public_modules())
def test_every_public_name_of_every_module_is_in_its_api_section(module):
    sections = api_sections()
    assert module in sections, f"docs/api.md has no section ## `{module}`"
    names = importlib.import_module(module).__all__
    missing = [name for name in names if not mentioned_in_code(name, sections[module])]
    assert not missing, f"docs/api.md's `{module}` section does not mention {missing}"


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(path):
    broken = []
    for target in links(path):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, fragment = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            broken.append(f"{target} (no heading with anchor #{fragment})")
    assert not broken, f"{path.relative_to(REPO)}: broken links: {broken}"


def test_docs_index_lists_every_guide():
    index = (REPO / "docs" / "README.md").read_text(encoding="utf-8")
    listed = {Path(target.partition("#")[0]).name for target in links(REPO / "docs" / "README.md")}
    missing = [p.name for p in (REPO / "docs").glob("*.md") if p.name != "README.md" and p.name not in listed]
    assert not missing, f"docs/README.md does not link {missing}"
    assert "docs/README.md" in (REPO / "README.md").read_text(encoding="utf-8"), "README.md must link the docs"
    assert index.strip()


def test_every_example_is_listed_with_its_command():
    listing = (REPO / "examples" / "README.md").read_text(encoding="utf-8")
    missing = [p.name for p in (REPO / "examples").glob("*.py") if p.name not in listing]
    assert not missing, f"examples/README.md does not list {missing}"


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(REPO)))
def test_example_paths_named_in_the_docs_exist(path):
    named = set(re.findall(r"\bexamples/[\w./-]+\.py\b", path.read_text(encoding="utf-8")))
    missing = sorted(name for name in named if not (REPO / name).exists())
    assert not missing, f"{path.relative_to(REPO)} names example scripts that do not exist: {missing}"
