"""Every repository path that README.md and docs/*.md name exists.

Paths are taken from markdown links (relative to the document) and from inline code and code blocks
(relative to the repository root), where they start with one of the repository's top-level folders.
Output paths of commands (after ``--out`` and the like, or ``OUT=``) are not inputs and are skipped, and
so are patterns (``*``, ``{a,b}``, ``<name>``, ``...``).
"""

import re
from pathlib import Path
import pytest

pytestmark = pytest.mark.tier("scripts")

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ROOTS = ("results", "docs", "benchmarks", "kvpop_hf", "training", "tests", "examples", "checkpoints")
PATH = re.compile(r"(?<![\w./-])((?:\.\./)*(?:%s)/[\w./-]*)" % "|".join(ROOTS))
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```|`[^`\n]+`", re.S)
OUTPUT_FLAGS = ("--out", "--out-prefix", "--output_dir", "--output-dir", "--plot", "--save", "--profile-dir")
PATTERN_CHARS = set("*{}<>$")  # and "[" right after a path: an optional part


def _clean(path: str) -> str | None:
    path = path.split("::")[0].split("#")[0].rstrip(".,:;")
    if not path or PATTERN_CHARS & set(path) or "..." in path:
        return None
    return path


def named_paths(doc: Path):
    """(line number, path as written, resolved path) for every repository path ``doc`` names."""
    text = doc.read_text()
    found = []
    for m in LINK.finditer(text):
        target = m.group(1)
        if "://" in target or target.startswith(("#", "mailto:")):
            continue
        path = _clean(target)
        if path:
            found.append((m.start(), path, (doc.parent / path).resolve()))
    for m in CODE.finditer(text):
        tokens = m.group(0).strip("`").split()
        for i, tok in enumerate(tokens):
            prev = tokens[i - 1] if i else ""
            if prev in OUTPUT_FLAGS or tok.startswith(("OUT=", "--out=")):
                continue
            word = tok.split("=", 1)[-1]
            for p in PATH.finditer(word):
                if word[p.end():p.end() + 1] in PATTERN_CHARS | {"["}:
                    continue  # a pattern such as tests/test_dms_*.py or checkpoints/dms_cr{88,94}
                path = _clean(p.group(1))
                if path:
                    found.append((m.start(), path, (REPO / path).resolve()))
    return [(text.count("\n", 0, pos) + 1, path, resolved) for pos, path, resolved in found]


def test_the_scan_finds_paths():
    readme = {path for _, path, _ in named_paths(REPO / "README.md")}
    assert any(p.startswith("docs/") for p in readme)
    assert any(p.startswith("results/") for p in readme)


def test_every_path_named_in_readme_and_docs_exists():
    missing = []
    for doc in DOCS:
        for line, path, resolved in named_paths(doc):
            if not resolved.exists():
                missing.append(f"{doc.relative_to(REPO)}:{line}: {path}")
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(sorted(set(missing)))
