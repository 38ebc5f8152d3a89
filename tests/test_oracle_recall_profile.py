"""benchmarks/oracle_recall_profile.py: bad input is refused before any work; a run on the shipped testbed teacher and
the cr88 student's scorer writes its table (a row per policy, decayed variants included), per-head CSV with every share
in [0, 1], and plot."""

import csv
from pathlib import Path

import pytest
from kvpop_lab.bench import oracle_recall_profile

pytestmark = pytest.mark.tier("scripts")

ROOT = Path(__file__).resolve().parents[1]
TEACHER = ROOT / "checkpoints" / "testbed-4k-teacher"
SCORER = ROOT / "checkpoints" / "testbed-4k-kvpop-cr88"




@pytest.mark.parametrize("extra,message", [
    (["--scorer", "kvpop"], "NAME=DIR"),
    (["--scorer", "kvpop=/no/such/folder"], "no such checkpoint folder"),
    (["--oracle-ks", "8,x"], "--oracle-ks"),
    (["--oracle-ks", "0"], "positive"),
    (["--log-gammas", "0.1"], "negative"),
])
def test_bad_arguments_fail_first(extra, message, capsys, tmp_path):
    with pytest.raises(SystemExit):
        oracle_recall_profile.parse_args(["--model", str(TEACHER), "--out", str(tmp_path)]
                                                           + extra)
    assert message in capsys.readouterr().err


def test_profile_of_a_scorer_on_the_testbed(tmp_path):
    oracle_recall_profile.main([
                    "--model", str(TEACHER), "--out", str(tmp_path), "--length", "512", "--n", "1", "--window", "32",
                    "--compression", "0.88", "--scorer", f"kvpop={SCORER}", "--baselines", "streaming",
                    "--oracle-ks", "4,16", "--log-gammas", "-0.1", "--device", "cpu"])
    table = (tmp_path / "table.md").read_text()
    assert "| kvpop | 61 |" in table and "| kvpop_lg-0.1 | 61 |" in table and "| streaming | 61 |" in table
    rows = list(csv.DictReader(open(tmp_path / "recall_per_head.csv")))
    assert {r["policy"] for r in rows} == {"streaming", "kvpop", "kvpop_lg-0.1"}
    for r in rows:
        for m in ("oracle_recall", "oracle_recall_top4", "oracle_recall_top16", "oracle_mass"):
            assert 0.0 <= float(r[m]) <= 1.0, r
    assert (tmp_path / "recall_vs_m.png").stat().st_size > 0
