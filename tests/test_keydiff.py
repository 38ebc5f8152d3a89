"""KeyDiff scorer: its priorities equal the rule computed by brute force, and the cache built on it keeps
exactly the contract's entries (whole prompt, chunks, token by token, left padding)."""

import pytest
import torch
from torch.nn import functional as F

from helpers import distinct_ids, left_padded, reference_logits, reference_priorities, run_chunks, run_tokens, \
    run_whole, tiny_model
from kvpop_hf import KVpopCache
from kvpop_hf.scorers import KeyDiffScorer


def test_priorities_follow_the_rule():
    g = torch.Generator().manual_seed(0)
    b, h, S, d, w = 2, 3, 17, 8, 4
    k, v = torch.randn(b, h, S, d, generator=g), torch.randn(b, h, S, d, generator=g)
    prio = reference_priorities(KeyDiffScorer(1, h, d), 0, k, v, w)
    for u in range(S):
        if u + w >= S:  # never leaves the window inside the sequence: never read
            assert torch.isinf(prio[:, :, u]).all()
            continue
        anchor = k[:, :, : u + w + 1].mean(2)
        expect = -F.cosine_similarity(k[:, :, u], anchor, dim=-1)
        torch.testing.assert_close(prio[:, :, u], expect, atol=1e-5, rtol=1e-5)


def test_far_from_the_mean_is_kept():
    """One key points away from all the others: it is the one kept in the single long-range slot."""
    scorer = KeyDiffScorer(1, 1, 2)
    k = torch.tensor([[1.0, 0.1], [1.0, -0.1], [-1.0, 0.0], [1.0, 0.05], [1.0, 0.0], [1.0, 0.02]]).view(1, 1, 6, 2)
    prio = reference_priorities(scorer, 0, k, k, window=2)
    assert prio[0, 0, :4].argmax().item() == 2


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_cache_matches_reference_mask(arch):
    model = tiny_model(arch)
    ids = distinct_ids(2, 40, seed=12)
    kw = dict(sinks=2, window=5, topk=6, scorer="keydiff")
    probe = KVpopCache(model.config, **kw)
    ref, _ = reference_logits(model, ids, probe.scorer, 2, 5, 6)
    for feed in (run_whole, run_tokens, run_chunks):
        torch.testing.assert_close(feed(model, ids, KVpopCache(model.config, **kw)), ref, atol=2e-5, rtol=0)


def test_left_padded_batch_equals_rows_alone():
    model = tiny_model("qwen3")
    rows = [distinct_ids(1, n, seed=n)[0] for n in (25, 18)]
    ids, mask, width = left_padded(rows)
    gen = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    kw = dict(sinks=2, window=4, topk=6, scorer="keydiff")
    batch = model.generate(ids, attention_mask=mask, past_key_values=KVpopCache(model.config, **kw), **gen)
    for i, r in enumerate(rows):
        alone = model.generate(r[None], attention_mask=torch.ones_like(r[None]),  # (id 0 is not padding here)
                               past_key_values=KVpopCache(model.config, **kw), **gen)
        assert torch.equal(batch[i, width:], alone[0, len(r):])
