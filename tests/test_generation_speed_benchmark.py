"""benchmarks/generation_speed.py end to end on a tiny model (CPU): every row kind, the synthetic fill,
the leak check, and redrawing a run from its CSV."""

from __future__ import annotations

import csv
from pathlib import Path

from kvpop_lab.bench import generation_speed
import pytest

pytestmark = pytest.mark.tier("scripts")


def read_rows(path: Path):
    return list(csv.DictReader(line for line in path.read_text().splitlines() if not line.startswith("#")))


def normalised(row: dict) -> dict:
    out = {}
    for key, value in row.items():
        try:
            x = float(value)
            out[key] = "nan" if x != x else round(x, 6)
        except (TypeError, ValueError):
            out[key] = value or None
    return out


def test_generation_speed_runs_and_redraws(tmp_path):
    prefix = tmp_path / "run"
    argv = ["--shape", "tiny", "--contexts", "64", "200", "--steps", "3", "--warmup", "2", "--sinks", "4",
            "--window", "16", "--topk", "44", "--prefill-chunk", "128", "--static-contexts", "64", "200",
            "--static-synthetic", "200", "--scorers", "knorm", "mlstm", "--batches", "2", "--batch-context", "200", "--leak-caches", "2",
            "--paired-repeats", "2", "--compile-backend", "eager", "--out-prefix", str(prefix)]
    assert generation_speed.main(argv) == 0
    rows = read_rows(prefix.with_suffix(".csv"))
    kinds = {(r["context"], r["batch"], r["cache"], r["mode"]) for r in rows}
    for ctx in ("64", "200"):
        for cache, mode in [("dynamic", "eager"), ("static", "eager"), ("static", "compiled"),
                            ("kvpop-knorm", "eager"), ("kvpop-knorm", "compiled"), ("kvpop-mlstm", "compiled")]:
            assert (ctx, "1", cache, mode) in kinds
    assert ("200", "2", "kvpop-mlstm", "compiled") in kinds
    paired = [r for r in rows if r["mode"] == "compiled-paired"]
    assert {(r["context"], r["cache"]) for r in paired} == {(c, n) for c in ("64", "200")
                                                            for n in ("kvpop-knorm", "kvpop-mlstm")}
    assert all(r["repeats"] == "2" and float(r["decode_ms_median"]) > 0 for r in paired)
    for r in rows:
        if r["mode"] == "compiled" and r["batch"] == "1":
            # compiled and eager decoding fed the same tokens agree (float32 on CPU)
            assert float(r["max_abs_dlogit"]) < 1e-4 and float(r["same_argmax"]) == 1.0
    text = prefix.with_suffix(".md").read_text()
    assert "paired decode, kvpop-mlstm" in text and "KVpopCaches created, filled" in text and prefix.with_suffix(".png").exists()
    again = tmp_path / "again"
    assert generation_speed.main(["--from-csv", str(prefix.with_suffix(".csv")), "--out-prefix", str(again)]) == 0
    assert [normalised(r) for r in read_rows(again.with_suffix(".csv"))] == [normalised(r) for r in rows]
    assert "KVpopCaches created, filled" in again.with_suffix(".md").read_text()


def test_dms_rows_cpu(tmp_path):
    """The dms row: decode ms/token and the cache's memory beside KVpop's at the same average budget."""
    prefix = tmp_path / "dms"
    argv = ["--shape", "tiny", "--contexts", "64", "200", "--steps", "3", "--warmup", "1", "--sinks", "4",
            "--window", "16", "--topk", "44", "--prefill-chunk", "128", "--rows", "dms", "kvpop", "--scorers", "knorm",
            "--compile-backend", "eager", "--out-prefix", str(prefix)]
    assert generation_speed.main(argv) == 0
    rows = read_rows(prefix.with_suffix(".csv"))
    dms = {r["context"]: r for r in rows if r["cache"] == "dms"}
    assert set(dms) == {"64", "200"} and all(r["mode"] == "eager" and float(r["decode_ms_median"]) > 0
                                             for r in dms.values())
    # synthetic gate: 1 of the 4 (layer, head)s keeps everything at 200 tokens -> about B = 64 entries on average
    assert abs(float(dms["200"]["kept_per_head"]) - 64) < 8
    kv = {r["context"]: r for r in rows if r["cache"] == "kvpop-knorm" and r["mode"] == "eager"}
    assert float(dms["200"]["cache_mb"]) > 0 and float(kv["200"]["cache_mb"]) > 0
    text = prefix.with_suffix(".md").read_text()
    assert "kept_per_head" in text and "B = 4+16+44 = 64;" in text


def test_the_run_backends_are_a_record_not_the_environment():
    """--mlstm-step and a kernel that disagreed with its reference reach the caches as a Backends record; the
    run leaves the environment as it found it."""
    import os
    from types import SimpleNamespace

    import torch

    from kvpop_hf import Backends

    before = dict(os.environ)
    notes = []
    agreed = ("eviction kernel check on cuda: 20/20 random states equal", "decode attention check (agreed)",
              "mLSTM step kernel check (agreed)")
    cuda = torch.device("cuda")
    assert generation_speed.run_backends(SimpleNamespace(mlstm_step="torch"), cuda, *agreed, notes) == \
        Backends(mlstm_step="torch")
    assert notes == ["mLSTM decode step: the torch path"]
    disagreed = ("eviction kernel check on cuda: 19/20 random states equal",
                 "decode attention check (disagreed: this run decodes with the reference)", "mLSTM (disagreed)")
    record = generation_speed.run_backends(SimpleNamespace(mlstm_step="triton"), cuda, *disagreed, notes)
    assert record == Backends(mlstm_step="torch", decode_eviction="torch", decode_attention="torch")
    assert dict(os.environ) == before
