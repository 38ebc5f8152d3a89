"""benchmarks/chunk_host_ops.py on small chunks: it counts operator calls, and the mLSTM's count does not
grow with the chunk length (all sub-chunks in one batched computation)."""

import pytest

from kvpop_lab.bench import chunk_host_ops

pytestmark = pytest.mark.tier("scripts")


def test_mlstm_host_ops_do_not_grow_with_the_chunk():
    small = chunk_host_ops.aten_calls("mlstm", 256, (2, 8, 30))
    large = chunk_host_ops.aten_calls("mlstm", 2048, (2, 8, 30))
    assert 0 < small and large - small < 40, (small, large)


def test_bad_lengths_are_refused():
    with pytest.raises(ValueError, match="--lengths"):
        chunk_host_ops.main(["--lengths", "0"])


def test_budget_flags_reach_the_table(tmp_path):
    out = tmp_path / "ops.md"
    assert chunk_host_ops.main(["--scorers", "knorm", "--lengths", "16", "--sinks", "2", "--window", "8", "--topk",
                                "30", "--out", str(out)]) == 0
    assert "B = 2+8+30," in out.read_text()
