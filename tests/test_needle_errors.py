"""kvpop_lab.testbed.needle_errors: the kinds of wrong needle answers, read from a kvpop-eval run folder."""

from __future__ import annotations

import json

import pytest

from kvpop_lab.testbed.needle_errors import classify_value, main, needle_errors
from kvpop_lab.testbed.tasks import make_problem

pytestmark = pytest.mark.tier("unit")


def test_classify_value():
    needles = ["4361391", "7123456", "3999999"]
    assert classify_value("4361391", "4361391", needles) == ("right", False)
    assert classify_value("4361391", "7361391", needles) == ("first_digit", True)  # 7 starts another needle
    assert classify_value("4361391", "5361391", needles) == ("first_digit", False)
    assert classify_value("4361391", "7123456", needles) == ("other_needle", True)
    assert classify_value("4361391", "1111", needles) == ("other", False)
    assert classify_value("4361391", "", needles) == ("other", False)


def _run_dir(tmp_path, rows, length=512, knobs=None):
    (tmp_path / "meta.json").write_text(json.dumps({"length": length, "knobs": knobs or {}}))
    (tmp_path / "outputs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def test_needle_errors_regenerates_the_problems(tmp_path, capsys):
    length, knobs = 512, {"niah_multikey": {"num_needles": 3}}
    rows = []
    for seed, how in ((0, "right"), (1, "swap_first"), (2, "other")):
        p = make_problem("niah_multikey", length, seed=seed, num_needles=3)
        other = next(v for v in p.meta["needles"].values() if v[0] != p.answer[0])  # a needle with another first digit
        pred = {"right": p.answer, "swap_first": other[0] + p.answer[1:], "other": other}[how]
        rows.append({"policy": "dense", "family": "niah_multikey", "seed": seed, "prediction": pred})
    q = make_problem("niah_multiquery", length, seed=5)
    a, b = q.answer.split(" , ")
    assert a[0] != b[0]
    rows.append({"policy": "dense", "family": "niah_multiquery", "seed": 5, "prediction": f"{b} , {b}"})
    rows.append({"policy": "snapkv", "family": "niah_multikey", "seed": 0, "prediction": "x"})  # another policy
    rows.append({"policy": "dense", "family": "vt", "seed": 0, "prediction": "x"})  # not a keyed family
    run = _run_dir(tmp_path, rows, length, knobs)

    got = needle_errors(run)
    mk = got["niah_multikey"]
    assert (mk["values"], mk["right"], mk["first_digit"], mk["other_needle"], mk["other"]) == (3, 1, 1, 1, 0)
    assert mk["first_from_other"] == 2
    mq = got["niah_multiquery"]
    assert (mq["values"], mq["right"], mq["other_needle"], mq["first_from_other"]) == (2, 1, 1, 1)
    assert mq["by_position"][0]["other_needle"] == 1 and mq["by_position"][1]["right"] == 1

    assert main([str(run)]) == 0
    assert "niah_multiquery: 2 asked values" in capsys.readouterr().out
    saved = json.loads((run / "needle_errors.json").read_text())
    assert saved["niah_multikey"]["values"] == 3 and saved["niah_multiquery"]["by_position"]["1"] == {"right": 1}


def test_needle_errors_reads_restated_answers(tmp_path):
    """With restate_key the answer puts each later key before its value; the values are still what is sorted."""
    knobs = {"niah_multiquery": {"num_queries": 3, "restate_key": True, "adjacent_key": True}}
    q = make_problem("niah_multiquery", 512, seed=2, **knobs["niah_multiquery"])
    a, b, c = q.meta["query_values"]
    pieces = q.answer.split(" , ")
    assert pieces[0] == a and pieces[1].endswith(f": {b}") and pieces[2].endswith(f": {c}")
    pred = " , ".join([a, pieces[1].replace(b, c), pieces[2][:-1]])  # right, another needle's, cut short
    run = _run_dir(tmp_path, [{"policy": "dense", "family": "niah_multiquery", "seed": 2, "prediction": pred}], 512,
                   knobs)
    mq = needle_errors(run)["niah_multiquery"]
    assert (mq["values"], mq["right"], mq["other_needle"], mq["other"]) == (3, 1, 1, 1)


def test_needle_errors_refuses_a_run_without_keyed_answers(tmp_path):
    run = _run_dir(tmp_path, [{"policy": "dense", "family": "vt", "seed": 0, "prediction": "x"}])
    with pytest.raises(ValueError, match="no niah_multikey/niah_multiquery rows of policy 'dense'"):
        needle_errors(run)
