"""The documentation points at things that exist, and the README stays a front page.

Checked in ``README.md``, ``CONTRIBUTING.md`` and every ``docs/*.md``:

- every relative Markdown link (``[text](path)``, ``[text](path#anchor)``, ``[text](#anchor)``)
  resolves, relative to the linking file, to a file or directory that exists; an anchor
  into a Markdown file must name one of its headings (GitHub's slugs). http(s) and mailto
  links are not followed;
- every repository path written in backticks that names a ``.py``, ``.md``, ``.json``,
  ``.yaml`` or ``.sh`` file (``megatrain_ds/streaming/weight_streamer.py``,
  ``bench/compare.py``) exists. A path is read from the repository root, or, when its first
  part is a subpackage of ``megatrain_ds`` (``streaming/weight_streamer.py``), from the
  package. Paths with placeholders (``<device>``, ``*``), absolute or home paths, and bare
  file names without a folder (``train.py``) are not repository paths;
- ``README.md`` is at most 15,000 characters, and ``docs/`` has at least 3 pages;
- the "Map of the package" in ``CONTRIBUTING.md`` has one row per subpackage and
  top-level module of ``megatrain_ds``, in the layer order of ``tests/test_layering.py``
  (``LAYERS``), and the modules a subpackage's row names are in that subpackage.

Fenced code blocks are skipped: they hold commands and examples, not references.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "megatrain_ds"
README_MAX_CHARS = 15_000
MIN_DOC_PAGES = 3

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
_REPO_PATH = re.compile(r"^(?:\./)?[A-Za-z0-9_.][A-Za-z0-9_.\-]*(?:/[A-Za-z0-9_.\-]+)+\.(?:py|md|json|yaml|sh)$")


def _doc_files() -> list[Path]:
    return [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]


def _prose(text: str) -> str:
    """The text with fenced code blocks blanked out (line numbers kept)."""
    return _FENCE.sub(lambda match: "\n" * match.group(0).count("\n"), text)


def _line(text: str, index: int) -> int:
    return text.count("\n", 0, index) + 1


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file (repeated headings get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    found = set()
    for match in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", _prose(path.read_text(encoding="utf-8")), re.MULTILINE):
        slug = _slug(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken_links(path: Path, text: str | None = None) -> list[str]:
    """Relative links in ``path`` (or in ``text``, read as if it were ``path``) that do not resolve."""
    text = _prose(path.read_text(encoding="utf-8") if text is None else text)
    problems = []
    for match in _LINK.finditer(text):
        target = match.group(1)
        if re.match(r"^[a-z][a-z0-9+.\-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
            continue
        where = f"{path.relative_to(REPO)}:{_line(text, match.start())}: [{target}]"
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            problems.append(f"{where} -> {resolved} does not exist")
        elif anchor and resolved.suffix == ".md" and resolved.is_file() and anchor not in anchors(resolved):
            problems.append(f"{where} -> no heading #{anchor} in {resolved.relative_to(REPO)}")
    return problems


def _resolve_repo_path(candidate: str) -> Path:
    candidate = candidate.removeprefix("./")
    first = candidate.split("/")[0]
    if (PACKAGE / first / "__init__.py").exists() and not (REPO / first).exists():
        return PACKAGE / candidate  # package-relative: streaming/weight_streamer.py
    return REPO / candidate


def missing_paths(path: Path, text: str | None = None) -> list[str]:
    """Repository paths in backticks in ``path`` (or ``text``) that name no existing file."""
    text = _prose(path.read_text(encoding="utf-8") if text is None else text)
    problems = []
    for match in _CODE_SPAN.finditer(text):
        for candidate in re.split(r"[\s,]+", match.group(2).strip()):
            if _REPO_PATH.match(candidate) and not _resolve_repo_path(candidate).exists():
                problems.append(f"{path.relative_to(REPO)}:{_line(text, match.start())}: `{candidate}` does not exist")
    return problems


@pytest.mark.parametrize("doc", _doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc: Path):
    assert doc.exists(), doc
    problems = broken_links(doc)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", _doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_backticked_repository_paths_exist(doc: Path):
    problems = missing_paths(doc)
    assert not problems, "\n".join(problems)


def test_readme_is_a_front_page():
    size = len((REPO / "README.md").read_text(encoding="utf-8"))
    assert size <= README_MAX_CHARS, (
        f"README.md has {size} characters (at most {README_MAX_CHARS}): move detail to docs/"
    )


def test_docs_has_pages():
    pages = sorted(p.name for p in (REPO / "docs").glob("*.md") if p.name != "README.md")
    assert len(pages) >= MIN_DOC_PAGES, pages
    assert (REPO / "docs" / "README.md").exists(), "docs/README.md indexes the pages"


def _layers() -> tuple[tuple[str, ...], ...]:
    """``LAYERS`` as written in tests/test_layering.py (read, not imported)."""
    tree = ast.parse((REPO / "tests" / "test_layering.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "LAYERS":
            return ast.literal_eval(node.value)
    raise AssertionError("LAYERS not found in tests/test_layering.py")


def map_rows(text: str) -> list[tuple[int, str, set[str]]]:
    """(layer, module, bare module files named) for each row of CONTRIBUTING's package map."""
    section = text.split("## Map of the package", 1)[1].split("\n## ", 1)[0]
    rows = []
    for match in re.finditer(r"^\|\s*(\d+)\s*\|\s*`megatrain_ds/([^`]+)`\s*\|(.*)\|\s*$", section, re.MULTILINE):
        named = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*\.py)`", match.group(3)))
        rows.append((int(match.group(1)), match.group(2), named))
    return rows


def map_problems(text: str) -> list[str]:
    expected = [
        (index, f"{name}/" if (PACKAGE / name).is_dir() else f"{name}.py")
        for index, names in enumerate(_layers())
        for name in names
    ]
    rows = map_rows(text)
    problems = []
    if [(layer, module) for layer, module, _ in rows] != expected:
        problems.append(f"map rows {[(layer, module) for layer, module, _ in rows]} != LAYERS order {expected}")
    for _, module, named in rows:
        if module.endswith("/"):
            missing = sorted(name for name in named if not (PACKAGE / module / name).exists())
            if missing:
                problems.append(f"megatrain_ds/{module}: the map names {missing}, which it does not hold")
    return problems


def test_the_package_map_follows_the_layers():
    problems = map_problems((REPO / "CONTRIBUTING.md").read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)


def test_the_checks_catch_what_they_should():
    """Each checker on made-up text: broken links, missing anchors and missing paths are
    reported; existing ones, external links, placeholders and code blocks are not."""
    readme = REPO / "README.md"
    good = (
        "[docs](docs/README.md) [perf](docs/performance.md#host-memory) [self](#two-commands) "
        "[web](https://example.com/nowhere.md) `megatrain_ds/engine.py` `streaming/weight_streamer.py` "
        "`bench/results/timeline_<device>.png` `train.py` `~/.cache/megatrain_ds/calibration.json`\n"
        "```bash\npython bench/nowhere.py  # [x](nowhere.md) `nowhere/at_all.py`\n```\n"
    )
    assert broken_links(readme, good) == []
    assert missing_paths(readme, good) == []
    bad = (
        "[a](docs/nowhere.md) [b](docs/performance.md#no-such-heading) [c](#no-such-heading)\n"
        "`megatrain_ds/nowhere.py` `streaming/nowhere.py` `bench/nowhere.sh` `configs/nowhere.yaml`\n"
    )
    assert len(broken_links(readme, bad)) == 3
    assert len(missing_paths(readme, bad)) == 4
    assert _slug("Planning a run: `megatrain plan`") == "planning-a-run-megatrain-plan"
    assert _slug("The planner's prediction") == "the-planners-prediction"
    contributing = (REPO / "CONTRIBUTING.md").read_text(encoding="utf-8")
    assert len(map_rows(contributing)) == sum(len(names) for names in _layers())
    swapped = contributing.replace("| 1 | `megatrain_ds/runtime/`", "| 1 | `megatrain_ds/state/`", 1)
    assert map_problems(swapped)
    assert map_problems(contributing.replace("`host_heap.py` (", "`heap.py` (", 1))
