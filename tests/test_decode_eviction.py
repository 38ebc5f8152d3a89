"""The fused decode-step eviction (Triton, interpreted on CPU) == its torch reference, on random states."""

import pytest
import torch

from kvpop_hf.ops.decode_eviction import evict_and_insert_reference, evict_and_insert_triton

pytestmark = pytest.mark.tier("unit")


def random_state(b, h, s, w, k, d, dv, seen, ties, seed):
    g = torch.Generator().manual_seed(seed)
    B = s + w + k
    keys = torch.randn(b, h, B, d, generator=g)
    values = torch.randn(b, h, B, dv, generator=g)
    pos = torch.full((b, h, B), -1, dtype=torch.long)
    prio = torch.full((b, h, B), float("-inf"))
    for r in range(b):
        n = min(int(seen[r]), B)
        pos[r, :, :n] = torch.randperm(10 * B + 1, generator=g)[:n].sort().values  # distinct, any order of slots
        p = torch.randn(h, n, generator=g)
        if ties:
            p = p.round()  # many equal priorities: the tie rules decide
        prio[r, :, :n] = p
    return keys, values, pos, prio


@pytest.mark.parametrize("s,w,k", [(2, 4, 6), (0, 3, 5), (4, 8, 0), (1, 2, 13)])
@pytest.mark.parametrize("ties", [False, True])
def test_kernel_matches_reference(s, w, k, ties):
    b, h, d, dv = 3, 2, 16, 8
    B = s + w + k
    for seed in range(6):
        g = torch.Generator().manual_seed(100 + seed)
        seen = torch.randint(0, 3 * B, (b,), generator=g)
        state = random_state(b, h, s, w, k, d, dv, seen, ties, seed)
        k_new, v_new = torch.randn(b, h, d, generator=g), torch.randn(b, h, dv, generator=g)
        p_leave = torch.randn(b, h, generator=g)
        if ties:
            p_leave = p_leave.round()
        p_new = torch.where(torch.rand(b, h, generator=g) < 0.5, float("-inf"), torch.randn(b, h, generator=g))
        ref = [x.clone() for x in state]
        got = [x.clone() for x in state]
        evict_and_insert_reference(*ref, seen, k_new, v_new, p_leave, p_new, s, w, k)
        evict_and_insert_triton(*got, seen, k_new, v_new, p_leave, p_new, s, w, k)
        for name, a, e in zip(("keys", "values", "pos", "prio"), got, ref):
            assert torch.equal(a, e), (name, seed)


def test_reference_replaces_only_a_leaving_winner():
    """A hand-made case: the token leaving the window beats the weakest slot (an old one among ties)."""
    s, w, k = 1, 2, 3
    keys = torch.arange(6, dtype=torch.float32).view(1, 1, 6, 1)
    values = keys.clone()
    pos = torch.tensor([[[0, 5, 6, 1, 3, 2]]])
    prio = torch.tensor([[[float("-inf"), float("-inf"), float("-inf"), 0.5, 0.2, 0.2]]])
    seen = torch.tensor([7])  # new token 7 goes to slot 1 + (7 - 1) % 2 = 1, displacing token 5
    evict_and_insert_reference(keys, values, pos, prio, seen, torch.tensor([[[9.0]]]), torch.tensor([[[9.0]]]),
                               torch.tensor([[0.3]]), torch.tensor([[float("-inf")]]), s, w, k)
    # weakest long-range slots: 4 (token 3) and 5 (token 2) tie at 0.2; the older token 2 goes
    assert pos.tolist() == [[[0, 7, 6, 1, 3, 5]]]
    assert keys.flatten().tolist() == [0, 9, 2, 3, 4, 1]
    assert prio[0, 0, 5].item() == pytest.approx(0.3)


@pytest.mark.parametrize("scorer", ["knorm", "mlstm"])
def test_cache_decoding_through_the_kernel(scorer, monkeypatch):
    """Token-by-token decoding with the kernel forced on == the torch path (logits and stored slots)."""
    from helpers import distinct_ids, run_tokens, tiny_model
    from kvpop_hf import KVpopCache

    model = tiny_model("qwen3")
    ids = distinct_ids(2, 40, seed=9)
    runs = {}
    for mode in ("torch", "triton"):
        monkeypatch.setenv("KVPOP_DECODE_EVICTION", mode)
        cache = KVpopCache(model.config, sinks=2, window=4, topk=6, scorer=scorer)
        runs[mode] = (run_tokens(model, ids, cache), [cache.stored_positions(i) for i in range(2)])
    torch.testing.assert_close(runs["triton"][0], runs["torch"][0], atol=0, rtol=0)
    for a, e in zip(runs["triton"][1], runs["torch"][1]):
        assert torch.equal(a, e)
