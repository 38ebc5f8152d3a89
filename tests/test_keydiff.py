"""KeyDiff scorer: its priorities equal the rule computed by brute force. (The cache built on it is checked
against the contract with the other scorers: test_cache_contract.py, test_cache_generation.py.)"""

import torch
from torch.nn import functional as F

from helpers import reference_priorities
from kvpop_hf.baselines.keydiff import KeyDiffScorer
import pytest

pytestmark = pytest.mark.tier("unit")


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
