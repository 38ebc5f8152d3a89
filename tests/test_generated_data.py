"""``--dataset NAME:SPEC``: generated training rows from a package's entry point (kvpop_hf/data/generated.py); the
laboratory installs ``testbed``."""

from __future__ import annotations

import pytest

from kvpop_hf.data.generated import generated_rows, generator_for

pytestmark = pytest.mark.tier("scripts")


def test_testbed_rows_come_from_the_laboratorys_entry_point():
    from kvpop_lab.testbed import build_tokenizer
    from kvpop_lab.testbed.training_rows import testbed_rows

    generator, spec = generator_for("testbed:reasoning,vt")
    assert generator is testbed_rows and spec == "reasoning,vt"
    rows = generated_rows("testbed:reasoning,vt", build_tokenizer(), 512, 3, seed=0)
    assert len(rows) == 3 and all(r["input_ids"].shape == r["labels"].shape == (512,) for r in rows)
    again = generated_rows("testbed:reasoning,vt", build_tokenizer(), 512, 3, seed=0)
    assert all((a["input_ids"] == b["input_ids"]).all() for a, b in zip(rows, again))  # seeded


@pytest.mark.parametrize("dataset", ["nvidia/Nemotron-Math-v2", "data.jsonl", "/tmp/folder", "c:\\data"])
def test_a_datasets_source_is_not_a_generator(dataset):
    assert generator_for(dataset) is None


def test_an_existing_local_path_with_a_colon_is_a_datasets_source(tmp_path):
    path = tmp_path / "run:1"
    path.mkdir()
    assert generator_for(str(path)) is None


def test_an_unknown_generator_names_the_installed_ones():
    with pytest.raises(ValueError, match=r"no installed package provides \(installed: .*testbed"):
        generator_for("nosuch:reasoning")


@pytest.mark.parametrize("spec, knobs, msg", [
    ("nosuch", [], "unknown ones"), ("", [], "names no family"), ("reasoning", ["reasoning.steps"], "FAMILY.KEY=VALUE")])
def test_bad_testbed_specs_are_refused(spec, knobs, msg):
    from kvpop_lab.testbed import build_tokenizer

    with pytest.raises(ValueError, match=msg):
        generated_rows(f"testbed:{spec}", build_tokenizer(), 256, 1, seed=0, knobs=knobs)


def test_the_commands_check_spec_and_knobs_before_loading_anything(tmp_path):
    from kvpop_hf.cli import retrofit, train_dms

    nothing = str(tmp_path / "no-model")
    common = ["--seq_len", "256", "--output_dir", str(tmp_path / "o"), "--report_to", "none"]
    with pytest.raises(ValueError, match="unknown ones"):
        retrofit.train(["--model", nothing, "--dataset", "testbed:nosuch"] + common)
    with pytest.raises(ValueError, match="FAMILY.KEY=VALUE"):
        train_dms.train(["--model", nothing, "--dataset", "testbed:reasoning", "--knob", "steps=4"] + common)
