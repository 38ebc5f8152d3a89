"""Generator knobs reach every tool that builds testbed problems (retrofit data, oracle eviction, kvpop-eval),
and the policy names of the differently trained scorers resolve their checkpoints."""

from pathlib import Path

import pytest

from kvpop_lab.testbed import build_tokenizer
from kvpop_lab.testbed.evaluate import parse_knobs
from kvpop_hf.policies import POLICIES, scan_checkpoints_dir

from kvpop_hf.cli import retrofit
from kvpop_lab.testbed.training_rows import testbed_examples as build_examples

pytestmark = pytest.mark.tier("scripts")


def test_parse_knobs_values_and_errors():
    assert parse_knobs(["reasoning.n_facts=10", "reasoning.steps=4", "lookup.n_facts=16"]) == {
        "reasoning": {"n_facts": 10, "steps": 4}, "lookup": {"n_facts": 16}}
    with pytest.raises(ValueError, match="FAMILY.KEY=VALUE"):
        parse_knobs(["reasoning.n_facts"])
    with pytest.raises(ValueError, match="unknown family"):
        parse_knobs(["nosuch.n_facts=3"])


def test_retrofit_examples_follow_the_knobs():
    tok = build_tokenizer()
    knobs = parse_knobs(["reasoning.n_facts=7", "reasoning.steps=2"])
    with_knobs = build_examples(["reasoning"], tok, 512, 2, seed=0, knobs=knobs)
    default = build_examples(["reasoning"], tok, 512, 2, seed=0)
    assert all(len(e["input_ids"]) == 512 for e in with_knobs + default)
    fact = tok.convert_tokens_to_ids("fact")
    assert [int((e["input_ids"] == fact).sum()) for e in with_knobs] == [7, 7]
    # two steps: the supervised target (trace + answer) is shorter than with the default 3 steps at 512 tokens
    assert all(int((a["labels"] >= 0).sum()) < int((b["labels"] >= 0).sum()) for a, b in zip(with_knobs, default))


def test_retrofit_knob_on_a_jsonl_dataset_is_an_error(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a b c"}\n')
    with pytest.raises(ValueError, match="--knob sets the knobs of a generated source"):
        retrofit.main(["--model", str(tmp_path), "--dataset", str(data), "--knob", "reasoning.steps=4",
                       "--output_dir", str(tmp_path / "o"), "--use_cpu", "True", "--report_to", "none"])


def test_oracle_eviction_rejects_bad_knobs_before_loading(tmp_path):
    from kvpop_lab.bench import oracle_eviction

    with pytest.raises(ValueError, match="FAMILY.KEY=VALUE"):
        oracle_eviction.main(["--out", str(tmp_path), "--model", str(tmp_path), "--knob", "steps=4"])


@pytest.mark.parametrize("gammas", ["0.1", "-0.1,x"])
def test_oracle_eviction_rejects_bad_log_gammas_before_loading(tmp_path, gammas, capsys):
    from kvpop_lab.bench import oracle_eviction

    with pytest.raises(SystemExit):
        oracle_eviction.main(["--out", str(tmp_path / "o"), "--model", str(tmp_path), f"--log-gammas={gammas}"])
    assert "--log-gammas" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_oracle_eviction_with_a_decay_adds_its_rows(tmp_path):
    """One oracle table per problem serves the plain oracle and each decayed one; a decay that outweighs every
    oracle score leaves the recency order of StreamingLLM, which keeps less of the answer than the oracle."""
    import csv

    from kvpop_lab.bench import oracle_eviction

    root = Path(__file__).resolve().parents[1]
    oracle_eviction.main(["--out", str(tmp_path), "--model", str(root / "checkpoints/testbed-4k-teacher"),
                          "--length", "512", "--n", "2", "--compression", "0.75", "--log-gammas=-1000"])
    rows = {r["policy"]: r for r in csv.DictReader(open(tmp_path / "results.csv"))}
    assert set(rows) == {"oracle", "oracle_lg-1000"}
    assert float(rows["oracle_lg-1000"]["lookup_acc"]) < float(rows["oracle"]["lookup_acc"])


def test_variant_policies_resolve_their_checkpoint_folders(tmp_path):
    for name in ("kvpop_distill_cr88", "kvpop_mlp_mean_cr88", "kvpop_cr94", "kvpop_mlp_distill_cr94",
                 "kvpop_mean_distill_cr88", "kvpop_mlp_mean_distill_cr94"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "kvpop_config.json").write_text("{}")
    found = scan_checkpoints_dir(tmp_path)
    assert set(found) == {("kvpop_distill", "cr88"), ("kvpop_mlp_mean", "cr88"), ("kvpop", "cr94"),
                          ("kvpop_mlp_distill", "cr94"), ("kvpop_mean_distill", "cr88"),
                          ("kvpop_mlp_mean_distill", "cr94")}
    assert POLICIES["kvpop_mean_distill"].own_model and POLICIES["kvpop_mlp_mean_distill"].own_model
    assert POLICIES["kvpop_distill"].own_model and POLICIES["kvpop_mlp_distill"].own_model
    assert not POLICIES["kvpop_mean"].own_model


def test_retrofit_help_lists_every_training_flag(capsys):
    """``training/retrofit.py --help`` shows the script's and KVpopTrainingArguments' flags, not only the two that
    the bf16 check parses first."""
    from kvpop_hf.cli import retrofit

    with pytest.raises(SystemExit) as exit_info:
        retrofit.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--log_gamma", "--topk", "--dataset", "--max_train_seconds", "--learning_rate"):
        assert flag in text
