"""benchmarks/recall_vs_quality.py: reads the EM of a kvpop-eval folder and the oracle recall of a recall profile
or of a kvpop-eval analysis; bad points are refused with the expected form."""

import csv
import json
from pathlib import Path

import pytest
from kvpop_lab.bench import recall_vs_quality

pytestmark = pytest.mark.tier("scripts")

ROOT = Path(__file__).resolve().parents[1]




def _eval_folder(path: Path, recall_rows=()):
    path.mkdir()
    with open(path / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["policy", "budget", "em", "n"])
        w.writeheader()
        w.writerow({"policy": "dense", "budget": "full", "em": 1, "n": 40})
        w.writerow({"policy": "kvpop", "budget": 492, "em": 0.85, "n": 40})
        w.writerow({"policy": "kvpop", "budget": 246, "em": 0.5, "n": 40})
    if recall_rows:
        with open(path / "recall_per_layer.csv", "w", newline="") as f:
            w = csv.DictWriter(f, ["policy", "budget", "layer", "head", "oracle_recall"])
            w.writeheader()
            for i, (budget, r) in enumerate(recall_rows):
                w.writerow({"policy": "kvpop", "budget": budget, "layer": i, "head": 0, "oracle_recall": r})
    return path


def test_points_are_read_from_both_recall_sources(tmp_path):
    mod = recall_vs_quality
    ev = _eval_folder(tmp_path / "eval", recall_rows=[(492, 0.5), (492, 0.7), (246, 0.1)])
    prof = tmp_path / "profile"
    prof.mkdir()
    (prof / "meta.json").write_text(json.dumps({"summary": [
        {"policy": "kvpop_p2", "budget": 492, "oracle_recall": 0.675},
        {"policy": "kvpop_p2", "budget": 246, "oracle_recall": 0.6}]}))
    out = tmp_path / "out"
    assert mod.main(["--out", str(out), "--budgets", "492", "--point", f"a={ev}:kvpop@{ev}:kvpop",
                     "--point", f"b={ev}:kvpop@{prof}:kvpop_p2", "--recall-line", "0.81"]) == 0
    rows = json.loads((out / "meta.json").read_text())["rows"]
    assert [(r["label"], r["em"], r["n"]) for r in rows] == [("a", 0.85, 40), ("b", 0.85, 40)]
    assert rows[0]["oracle_recall"] == pytest.approx(0.6) and rows[1]["oracle_recall"] == pytest.approx(0.675)
    assert "| b | 0.850 (n = 40) | 0.675 |" in (out / "table.md").read_text()
    assert (out / "recall_vs_em.png").stat().st_size > 0


def test_bad_points_are_refused(tmp_path, capsys):
    mod = recall_vs_quality
    ev = _eval_folder(tmp_path / "eval")
    with pytest.raises(SystemExit):
        mod.main(["--out", str(tmp_path / "o"), "--budgets", "492", "--point", f"a={ev}:kvpop"])
    assert "LABEL=EM_DIR:EM_POLICY@RECALL_DIR:RECALL_POLICY" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mod.main(["--out", str(tmp_path / "o"), "--budgets", "492", "--point", f"a=/no/such:kvpop@{ev}:kvpop"])
    assert "is not a folder" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no row for policy 'kvpop' at budget 123"):
        mod.main(["--out", str(tmp_path / "o"), "--budgets", "123", "--point", f"a={ev}:kvpop@{ev}:kvpop"])
    with pytest.raises(ValueError, match="neither recall_per_layer.csv"):
        mod.main(["--out", str(tmp_path / "o"), "--budgets", "492", "--point", f"a={ev}:kvpop@{ev}:kvpop"])
