"""results/: small CSV tables, a few plots, and RESULTS.md generated from them by benchmarks/build_results_page.py."""

import csv
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
    assert on_disk - {"index.csv"} == listed, "every CSV and PNG under results/ is listed in results/index.csv"
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
