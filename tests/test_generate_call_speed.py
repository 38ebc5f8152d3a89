"""benchmarks/generate_call_speed.py on a tiny model (CPU): the CSV of record's exact columns, one
row per (cache, scorer, context, batch) with left-padded batches, both processes of --compile-reuse, the fused
projections' rows after the separate ones, and the
refusal of a token count that leaves nothing to time."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from kvpop_lab.bench import generate_call_speed
from kvpop_lab.bench import generation_speed

pytestmark = pytest.mark.tier("scripts")

TINY = ["--shape", "tiny", "--sinks", "4", "--window", "16", "--topk", "44", "--prefill-chunk", "128", "--new-tokens",
        "7", "--warmup", "2"]


def rows_of(prefix: Path):
    with open(prefix.with_suffix(".csv")) as fh:
        return list(csv.DictReader(fh))


def test_budget_flags(capsys):
    args = generate_call_speed.parser().parse_args([])
    assert (args.sinks, args.window, args.topk) == (4, 256, 3836)
    args = generate_call_speed.parser().parse_args(TINY)
    assert (args.sinks, args.window, args.topk) == (4, 16, 44)
    assert "--budget" not in generate_call_speed.parser().format_help()
    with pytest.raises(SystemExit) as exc:
        generate_call_speed.main(["--shape", "tiny", "--budget", "4", "16", "44"])
    assert exc.value.code == 2 and "pass --sinks 4 --window 16 --topk 44" in capsys.readouterr().err


def test_generate_call_rows(tmp_path):
    prefix = tmp_path / "gen"
    argv = [*TINY, "--contexts", "150", "--batches", "1", "3", "--scorers", "knorm", "mlstm",
            "--static-max-batch", "1", "--out-prefix", str(prefix)]
    assert generate_call_speed.main(argv) == 0
    rows = rows_of(prefix)
    assert list(rows[0]) == generate_call_speed.COLUMNS
    got = {(r["cache"], r["scorer"], r["batch"]) for r in rows}
    assert got == {("static", "", "1"), ("kvpop", "knorm", "1"), ("kvpop", "mlstm", "1"), ("kvpop", "knorm", "3"),
                   ("kvpop", "mlstm", "3")}
    assert all(float(r["decode_ms"]) > 0 and r["process"] == "first" for r in rows)
    assert "generate" in prefix.with_suffix(".md").read_text()


def test_run_ahead_rows_in_their_own_csv(tmp_path):
    prefix = tmp_path / "gen"
    argv = [*TINY, "--contexts", "120", "--batches", "2", "--scorers", "mlp", "--loops", "stock", "run_ahead",
            "--out-prefix", str(prefix)]
    assert generate_call_speed.main(argv) == 0
    stock, ahead = rows_of(prefix), rows_of(tmp_path / "gen_run_ahead")
    assert list(ahead[0]) == generate_call_speed.COLUMNS
    for rows in (stock, ahead):
        assert {(r["cache"], r["scorer"]) for r in rows} == {("static", ""), ("kvpop", "mlp")}
        assert all(float(r["decode_ms"]) > 0 for r in rows)
    assert "run_ahead" in prefix.with_suffix(".md").read_text()


def test_fused_rows_in_their_own_csv_after_the_separate_ones(tmp_path, monkeypatch):
    prefix = tmp_path / "gen"
    argv = [*TINY, "--contexts", "100", "--caches", "kvpop", "--scorers", "knorm", "--projections", "fused",
            "separate", "--out-prefix", str(prefix)]
    built, real = [], generate_call_speed.KVpopCache

    def recording(*args, **kwargs):  # the budget of every cache the run builds
        built.append((kwargs["sinks"], kwargs["window"], kwargs["topk"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(generate_call_speed, "KVpopCache", recording)
    assert generate_call_speed.main(argv) == 0
    assert built and set(built) == {(4, 16, 44)}
    separate, fused = rows_of(prefix), rows_of(tmp_path / "gen_fused")
    assert list(fused[0]) == generate_call_speed.COLUMNS
    assert len(separate) == len(fused) == 1 and float(fused[0]["decode_ms"]) > 0
    table = prefix.with_suffix(".md").read_text()
    assert table.index("| separate |") < table.index("| fused |")


def test_compile_reuse_runs_two_processes(tmp_path):
    prefix = tmp_path / "reuse"
    argv = [*TINY, "--contexts", "100", "--caches", "kvpop", "--scorers", "knorm", "--compile-reuse",
            str(tmp_path / "cc"), "--out-prefix", str(prefix)]
    assert generate_call_speed.main(argv) == 0
    assert [r["process"] for r in rows_of(prefix)] == ["first", "second"]


def test_too_few_tokens_is_refused():
    with pytest.raises(ValueError, match="--new-tokens 4 leaves no timed step"):
        generate_call_speed.main([*TINY, "--new-tokens", "4"])


def test_left_padded_prompts():
    ids, mask = generate_call_speed.prompts(3, 10, 50, "cpu")
    assert mask.sum(1).tolist() == [10, 8, 5] and (ids[mask == 0] == 0).all() and mask[:, -1].all()


def test_in_place_fill_matches_the_prefilled_layout():
    """--synthetic-from leaves what prefill_in_chunks leaves, but for the contents: per row the tokens seen, the
    sinks and window in their slots, topk distinct older tokens, and the padded token count."""
    import torch
    from kvpop_hf import KVpopCache, prefill_in_chunks

    model = generation_speed.build_model("tiny", torch.device("cpu"), torch.float32, 512)
    model.set_attn_implementation("kvpop")
    ids, mask = generate_call_speed.prompts(3, 200, model.config.vocab_size, "cpu")
    real = KVpopCache(model.config, sinks=4, window=16, topk=44, scorer="knorm")
    prefill_in_chunks(model, real, ids, 64, attention_mask=mask)
    fake = KVpopCache(model.config, sinks=4, window=16, topk=44, scorer="knorm")
    generation_speed.fill_kvpop(fake, model, mask)
    for a, b in zip(real.layers, fake.layers):
        assert torch.equal(a.seen, b.seen) and int(a.tokens) == int(b.tokens) == 199
        assert torch.equal(a.pos[..., :20], b.pos[..., :20])  # sinks and the window ring
        long_range = b.pos[..., 20:]
        assert (long_range >= 4).all() and (long_range <= (b.seen - 17)[:, None, None]).all()
        assert (long_range.sort(-1).values.diff(dim=-1) > 0).all()


def test_in_place_rows_and_a_failed_generate(tmp_path, monkeypatch):
    """--synthetic-from rows decode through generate; a generate that raises is retried once after a dynamo
    reset and then written as ``error``."""
    prefix = tmp_path / "syn"
    argv = [*TINY, "--contexts", "150", "--batches", "1", "2", "--scorers", "mlstm", "--synthetic-from", "2",
            "--out-prefix", str(prefix)]
    assert generate_call_speed.main(argv) == 0
    rows = rows_of(prefix)
    assert [(r["cache"], r["batch"]) for r in rows] == [("static", "1"), ("kvpop", "1"), ("static", "2"),
                                                        ("kvpop", "2")]
    assert all(float(r["decode_ms"]) > 0 for r in rows)
    assert "| in place |" in prefix.with_suffix(".md").read_text()

    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        raise KeyError("op25")

    monkeypatch.setattr(generate_call_speed, "generate_once", failing)
    assert generate_call_speed.main([*TINY, "--contexts", "150", "--caches", "kvpop", "--scorers", "knorm",
                                     "--out-prefix", str(prefix)]) == 0
    assert len(calls) == 2 and rows_of(prefix)[0]["decode_ms"] == "error"


def test_out_of_memory_row_names_where(tmp_path, monkeypatch, capsys):
    """A generate that runs out of memory gives an OOM row (no retry) and says where the allocation failed."""
    import torch

    def oom(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 77.50 GiB")

    monkeypatch.setattr(generate_call_speed, "generate_once", oom)
    prefix = tmp_path / "oom"
    assert generate_call_speed.main([*TINY, "--contexts", "150", "--caches", "static", "--out-prefix", str(prefix)]) == 0
    assert rows_of(prefix)[0]["decode_ms"] == "OOM"
    assert "out of memory at test_generate_call_speed.py" in capsys.readouterr().out


def test_in_place_fills_run_without_autograd(tmp_path, monkeypatch):
    """The fills' forward must not record an autograd graph (it kept every layer's expanded K/V at 32k)."""
    seen = []
    real = generate_call_speed.fill_static_in_place

    def spy(*a, **k):
        seen.append(torch.is_grad_enabled())
        return real(*a, **k)

    monkeypatch.setattr(generate_call_speed, "fill_static_in_place", spy)
    argv = [*TINY, "--contexts", "100", "--batches", "2", "--caches", "static", "--synthetic-from", "2",
            "--out-prefix", str(tmp_path / "fill")]
    assert generate_call_speed.main(argv) == 0
    assert seen == [False]
