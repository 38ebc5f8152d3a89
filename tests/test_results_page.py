"""results/: small CSV tables, a few plots, and RESULTS.md generated from them by benchmarks/build_results_page.py."""

import csv
import re
import shutil
import subprocess
import sys
from pathlib import Path
import pytest

pytestmark = pytest.mark.tier("scripts")

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "results"
SCRIPT = REPO / "benchmarks" / "build_results_page.py"


def run_builder(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True)


def test_committed_page_is_what_the_csvs_give():
    res = run_builder("--check")
    assert res.returncode == 0, res.stderr


def test_rebuilding_gives_identical_text(tmp_path):
    out = tmp_path / "RESULTS.md"
    res = run_builder("--out", str(out))
    assert res.returncode == 0, res.stderr
    assert out.read_text() == (RESULTS / "RESULTS.md").read_text()


def test_check_fails_on_a_stale_page(tmp_path):
    stale = tmp_path / "RESULTS.md"
    stale.write_text((RESULTS / "RESULTS.md").read_text().replace("0.950", "0.951", 1))
    res = run_builder("--check", "--out", str(stale))
    assert res.returncode == 1
    assert "build_results_page.py" in res.stderr


def test_every_table_and_plot_is_on_the_page_and_every_row_has_its_provenance():
    index = list(csv.DictReader(open(RESULTS / "index.csv")))
    listed = {row["file"] for row in index}
    on_disk = {p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.suffix in (".csv", ".png")}
    assert on_disk - {"index.csv", "summary.csv"} == listed, "every CSV and PNG under results/ is listed in results/index.csv"
    for name in sorted(n for n in listed if n.endswith(".csv")):
        rows = list(csv.DictReader(open(RESULTS / name)))
        assert rows, name
        for row in rows:
            assert all(row[k].strip() for k in ("command", "commit", "date")), (name, row)


def test_results_stays_small():
    files = [p for p in RESULTS.rglob("*") if p.is_file()]
    assert len(files) <= 80, f"{len(files)} files under results/ (at most 80)"
    assert sum(p.stat().st_size for p in files) <= 1_000_000


def test_a_table_without_provenance_columns_is_refused(tmp_path):
    shutil.copy(RESULTS / "index.csv", tmp_path / "index.csv")
    for row in csv.DictReader(open(RESULTS / "index.csv")):
        (tmp_path / row["file"]).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(RESULTS / row["file"], tmp_path / row["file"])
    (tmp_path / "speed_decode_h200.csv").write_text("context,decode_ms\n4096,7.9\n")
    res = run_builder("--results-dir", str(tmp_path), "--check")
    assert res.returncode != 0
    assert "speed_decode_h200.csv" in res.stderr and "command,commit,date" in res.stderr


def test_an_index_naming_a_missing_file_is_refused(tmp_path):
    (tmp_path / "index.csv").write_text("file,section,title,caption\nnot_there.csv,speed,x,\n")
    res = run_builder("--results-dir", str(tmp_path), "--check")
    assert res.returncode != 0
    assert "not_there.csv" in res.stderr


def page_anchors(text: str) -> set[str]:
    """The anchors GitHub gives the page's headings (lower case, punctuation but ``_`` and ``-`` dropped, spaces to
    ``-``, a repeated anchor suffixed ``-1``, ``-2``, ...), computed here apart from the builder's."""
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", text, re.M):
        slug = "".join(ch for ch in heading.strip().lower() if ch.isalnum() or ch in "_- ").replace(" ", "-")
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def summary_rows(text: str) -> list[list[str]]:
    """The cells of the page's opening table: the lines between the title and the first section."""
    head = text.split("\n## ", 1)[0]
    rows = [line for line in head.splitlines() if line.startswith("| ") and not line.startswith("| question |")]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in rows]


def test_the_page_opens_with_a_summary_of_the_four_questions_linked_to_existing_headings():
    text = (RESULTS / "RESULTS.md").read_text()
    assert text.index("| question | figure | device | table |") < text.index("\n## How fast")
    rows = summary_rows(text)
    assert {r[0] for r in rows} == {"How fast", "How much memory", "How good", "At what training cost"}
    anchors = page_anchors(text)
    index = {row["file"]: row for row in csv.DictReader(open(RESULTS / "index.csv"))}
    for question, figure, device, link in rows:
        m = re.fullmatch(r"\[`([^`]+)`\]\(#([^)]+)\)", link)
        assert m, link
        name, anchor = m.groups()
        assert anchor in anchors, f"{link} points at no heading of the page"
        assert name in index and name.endswith(".csv")
        assert anchor.endswith(name.replace(".", "").replace("/", "")), (anchor, name)
        assert figure and device and "{" not in figure + device, (figure, device)


def test_every_number_of_the_summary_is_a_cell_of_its_table():
    text = (RESULTS / "RESULTS.md").read_text()
    for question, figure, device, link in summary_rows(text):
        name = re.search(r"`([^`]+)`", link).group(1)
        cells = {v for row in csv.DictReader(open(RESULTS / name)) for v in row.values()}
        for number in re.findall(r"(?<![\w.-])(\d+(?:\.\d+)?)x?(?![\w.%-])", figure):
            if number in ("0", "1", "32", "80"):  # seed 0, batch 1 or 32, 80 problems: words of the text
                continue
            assert any(number in c for c in cells), f"{number} of {figure!r} is in no cell of {name}"


def test_a_summary_selector_that_matches_no_row_or_several_is_refused(tmp_path):
    for name in ("index.csv", "summary.csv"):
        shutil.copy(RESULTS / name, tmp_path / name)
    for row in csv.DictReader(open(RESULTS / "index.csv")):
        (tmp_path / row["file"]).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(RESULTS / row["file"], tmp_path / row["file"])
    good = (RESULTS / "summary.csv").read_text()
    for broken, says in (("system=kvpop;context=131072;batch=1", "matches 0 rows"),
                         ("trainer=lora_sft;seq_len=32768", "matches 2 rows"),
                         ("decode_ms|", "has no column")):
        replacement = {"system=kvpop;context=131072;batch=1": "system=kvpop;context=65536;batch=1",
                       "trainer=lora_sft;seq_len=32768": "trainer=lora_sft",
                       "decode_ms|": "decode_seconds|"}[broken]
        assert broken in good
        (tmp_path / "summary.csv").write_text(good.replace(broken, replacement, 1))
        res = run_builder("--results-dir", str(tmp_path), "--check")
        assert res.returncode != 0 and says in res.stderr and "summary.csv line" in res.stderr, res.stderr


def test_links_into_the_results_page_point_at_its_headings():
    anchors = page_anchors((RESULTS / "RESULTS.md").read_text())
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "model_cards").glob("*.md"))]
    for doc in docs:
        for anchor in re.findall(r"RESULTS\.md#([^)\s]+)\)", doc.read_text()):
            assert anchor in anchors, f"{doc.relative_to(REPO)} links to RESULTS.md#{anchor}, no heading of the page"
