"""kvpop_lab.testbed.oracle: the future-attention oracle replayed through a KVpopCache."""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import kvpop_hf  # noqa: F401  (registers the "kvpop" attention)
from kvpop_hf import KVpopCache
from kvpop_hf.compat import with_cache
from kvpop_lab.testbed.oracle import OUTSIDE, OracleScorer, oracle_table
from kvpop_hf.ops.targets import future_attention_target_reference

pytestmark = pytest.mark.tier("scripts")


def _model():
    cfg = Qwen3Config(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    m = Qwen3ForCausalLM(cfg).eval()
    m.set_attn_implementation("kvpop")
    return m


def test_table_matches_the_reference_oracle():
    from kvpop_lab.testbed.qkv import record_qkv
    from kvpop_hf.ops.targets import dense_causal_lse
    m = _model()
    ids = torch.randint(0, 100, (1, 50), generator=torch.Generator().manual_seed(1))
    table = oracle_table(m, ids, window=6)
    assert table.shape == (2, 2, 50)
    for layer, (q, k, _, scale) in record_qkv(m, ids).items():
        ref = future_attention_target_reference(q, k, dense_causal_lse(q, k, scale), 6, scale=scale)[0]
        torch.testing.assert_close(table[layer], ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk", [0, 7, 1])
def test_cache_keeps_the_oracle_top_k(chunk):
    m = _model()
    S, sinks, window, topk = 60, 2, 8, 10
    ids = torch.randint(0, 100, (1, S), generator=torch.Generator().manual_seed(2))
    table = oracle_table(m, ids, window=window)
    cache = KVpopCache(m.config, sinks=sinks, window=window, topk=topk, scorer=OracleScorer(table).bind_head_dim(16))
    step = chunk or S
    for s in range(0, S, step):
        m(ids[:, s:s + step], **with_cache(m, cache), use_cache=True)
    for layer in range(2):
        kept = cache.stored_positions(layer)[0]
        for h in range(2):
            long_range = table[layer, h, sinks:S - window].topk(topk).indices + sinks
            want = set(range(sinks)) | set(range(S - window, S)) | set(long_range.tolist())
            assert set(kept[h].tolist()) == want


def test_positions_outside_the_table_score_lowest():
    sc = OracleScorer(torch.arange(12.0).view(1, 2, 6)).bind_head_dim(4)
    pos = torch.tensor([[[-1, 0, 5, 6], [2, 3, 9, -1]]])
    out = sc.score(0, None, None, pos)
    assert out.tolist() == [[[OUTSIDE, 0.0, 5.0, OUTSIDE], [8.0, 9.0, OUTSIDE, OUTSIDE]]]
    with pytest.raises(ValueError, match="num_layers, kv_heads, S"):
        OracleScorer(torch.zeros(2, 3))


def test_max_table_against_a_loop():
    from kvpop_lab.testbed.qkv import record_qkv
    m = _model()
    S, window = 12, 3
    ids = torch.randint(0, 100, (1, S), generator=torch.Generator().manual_seed(3))
    got = oracle_table(m, ids, window, kind="max")
    for layer, (q, k, _, scale) in record_qkv(m, ids).items():
        for h in range(2):
            for t in range(S):
                best = 0.0
                for qh in (2 * h, 2 * h + 1):
                    for d in range(t + window, S):
                        w = torch.softmax(q[0, qh, d] @ k[0, h, :d + 1].T * scale, -1)[t].item()
                        best = max(best, w)
                assert abs(got[layer, h, t].item() - torch.log(torch.tensor(1e-6 + best)).item()) < 1e-4


def test_oracle_table_kinds():
    m = _model()
    ids = torch.randint(0, 100, (1, 30), generator=torch.Generator().manual_seed(4))
    assert oracle_table(m, ids, 4, kind="max").shape == oracle_table(m, ids, 4).shape == (2, 2, 30)
    with pytest.raises(ValueError, match="mean', 'max' or 'p<x>'"):
        oracle_table(m, ids, 4, kind="sum")
    with pytest.raises(ValueError, match="mean', 'max' or 'p<x>'"):
        oracle_table(m, ids, 4, kind="p1")


def test_power_mean_table_is_the_training_target_of_each_layer():
    """kind="p<x>": per layer, the power-mean target the trainer uses (mean over the query heads of a KV head)."""
    from kvpop_lab.testbed.qkv import record_qkv
    from kvpop_hf.ops.targets import dense_causal_lse, future_attention_target_reference
    m = _model()
    ids = torch.randint(0, 100, (1, 20), generator=torch.Generator().manual_seed(5))
    got = oracle_table(m, ids, 3, kind="p4")
    for layer, (q, k, _, scale) in record_qkv(m, ids).items():
        want = future_attention_target_reference(q, k, dense_causal_lse(q, k, scale), 3, scale=scale, reduce="p4")[0]
        torch.testing.assert_close(got[layer], want, atol=1e-5, rtol=1e-5)
    mx, mean = oracle_table(m, ids, 3, kind="max"), oracle_table(m, ids, 3)
    assert bool((got <= mx + 1e-5).all() and (got >= mean - 1e-5).all())
