"""Every repository path and module that README.md, docs/*.md and the laboratory's notes (benchmarks/docs/*.md) name
exists.

Paths are taken from markdown links (relative to the document), and from inline code, code blocks and the prose
(relative to the repository root) where they start with one of the repository's top-level folders. Output paths of
commands (after ``--out`` and the like, or ``OUT=``) are not inputs and are skipped, and so are patterns (``*``,
``{a,b}``, ``<name>``, ``...``). Dotted names (``kvpop_hf.ops.flex_compiled``, ``kvpop_lab.peers.score``,
``kvpop_hf.compat.with_cache``) must name a module of the tree, or a name that module defines or imports.
"""

import re
from pathlib import Path
import pytest

pytestmark = pytest.mark.tier("scripts")

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "benchmarks" / "docs").glob("*.md"))]
ROOTS = ("results", "docs", "benchmarks", "kvpop_hf", "training", "tests", "examples", "checkpoints")
PATH = re.compile(r"(?<![\w./-])((?:\.\./)*(?:%s)/[\w./-]*)" % "|".join(ROOTS))
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```|`[^`\n]+`", re.S)
OUTPUT_FLAGS = ("--out", "--out-prefix", "--output_dir", "--output-dir", "--plot", "--save", "--profile-dir")
PATTERN_CHARS = set("*{}<>$")  # and "[" right after a path: an optional part


MODULE = re.compile(r"(?<![\w./-])((?:kvpop_hf|kvpop_lab)(?:\.\w+)+)")
PACKAGES = {"kvpop_hf": REPO / "kvpop_hf", "kvpop_lab": REPO / "benchmarks" / "kvpop_lab"}


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
    prose = CODE.sub(lambda m: " " * len(m.group(0)), LINK.sub(lambda m: " " * len(m.group(0)), text))
    for p in PATH.finditer(prose):
        if prose[p.end():p.end() + 1] in PATTERN_CHARS | {"["}:
            continue
        path = _clean(p.group(1))
        if path:
            found.append((p.start(), path, (REPO / path).resolve()))
    return [(text.count("\n", 0, pos) + 1, path, resolved) for pos, path, resolved in found]


def name_resolves(name: str) -> bool:
    """Whether a dotted ``kvpop_hf.`` / ``kvpop_lab.`` name is a module (or package) of the tree, or a module followed
    by a name that module defines (def, class, assignment), imports or lists as a string (a lazy ``__getattr__``)."""
    parts = name.split(".")
    path, i = PACKAGES[parts[0]], 1
    while i < len(parts) and path.is_dir():
        if (path / parts[i]).is_dir():
            path = path / parts[i]
        elif (path / f"{parts[i]}.py").is_file():
            path = path / f"{parts[i]}.py"
        else:
            break
        i += 1
    if i == len(parts):
        return True
    source = path if path.suffix == ".py" else path / "__init__.py"
    if not source.is_file():
        return False
    attr = re.escape(parts[i])
    defined = rf"(?:def|class)\s+{attr}\b|^\s*{attr}\s*[:=]|\bimport\b[^\n]*\b{attr}\b|^\s+{attr},|[\"']{attr}[\"']"
    return re.search(defined, source.read_text(), re.M) is not None


def named_modules(doc: Path):
    """(line number, dotted name) for every ``kvpop_hf.`` / ``kvpop_lab.`` name ``doc`` mentions."""
    text = doc.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1).rstrip(".")) for m in MODULE.finditer(text)]


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


SHORT_PATH = re.compile(r"(?<![\w./-])([\w-]+(?:/[\w-]+)+\.py)\b")


def short_paths(doc: Path):
    """(line number, path) for every relative ``dir/file.py`` in ``doc``'s code that does not start at the root
    (``kvp/train.py`` inside the section on ``kvpop_hf/baselines/kvp``)."""
    text = doc.read_text()
    found = []
    for m in CODE.finditer(text):
        for p in SHORT_PATH.finditer(m.group(0)):
            if not p.group(1).startswith(tuple(f"{root}/" for root in ROOTS)):
                found.append((text.count("\n", 0, m.start()) + 1, p.group(1)))
    return found


def test_every_short_source_path_in_readme_and_docs_is_a_file_of_the_tree():
    sources = {p.relative_to(REPO).as_posix() for root in ROOTS if (REPO / root).is_dir()
               for p in (REPO / root).rglob("*.py")}
    missing = [f"{doc.relative_to(REPO)}:{line}: {path}" for doc in DOCS if REPO / "benchmarks" not in doc.parents
               for line, path in short_paths(doc) if not any(s.endswith("/" + path) for s in sources)]
    assert not missing, "source files the docs cite that no folder of the tree holds:\n" + "\n".join(missing)


def test_every_module_named_in_readme_and_docs_exists():
    missing = [f"{doc.relative_to(REPO)}:{line}: {name}" for doc in DOCS for line, name in named_modules(doc)
               if not name_resolves(name)]
    assert not missing, "modules or names the docs cite that the tree does not have:\n" + "\n".join(sorted(set(missing)))


def test_the_checks_catch_a_stale_path_and_a_stale_name(tmp_path):
    doc = tmp_path / "stale.md"
    doc.write_text("See kvpop_hf/attention_old.py and `benchmarks/not_there.py`; it patches\n"
                   "kvpop_hf.attention._flex_chunk_attention and kvpop_lab.bench.no_such_module;\n"
                   "traces: `kvp/traces.py`.\n")
    assert {path for _, path, resolved in named_paths(doc) if not resolved.exists()} == {
        "kvpop_hf/attention_old.py", "benchmarks/not_there.py"}
    assert [name for _, name in named_modules(doc) if not name_resolves(name)] == [
        "kvpop_hf.attention._flex_chunk_attention", "kvpop_lab.bench.no_such_module"]
    assert name_resolves("kvpop_hf.compat.with_cache") and name_resolves("kvpop_lab.peers.score")
    assert short_paths(doc) == [(3, "kvp/traces.py")]
