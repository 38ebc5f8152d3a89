"""Analytic FlexAttention block masks (training sparse attention, transposed target pass) == the blocks of the
dense mask, == create_block_mask, == the tile-by-tile builder; the simplified int32 mask_mod == the reference mask."""

import random
import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from kvpop_hf.trainer.block_masks import future_block_flags, sparse_block_flags
from kvpop_hf.ops.running_topk import running_topk, sparse_mask_reference
from kvpop_hf.trainer.sparse_attention import sparse_attention_block_mask, sparse_mask_mods
from kvpop_hf.ops.targets import future_block_mask_for, future_mask_mod

pytestmark = pytest.mark.tier("unit")

warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")


def flags_of_dense(m: torch.Tensor, block: int):
    """(partial, full) of a dense ``[b, h, L, C]`` mask; padding counts as masked."""
    b, h, L, C = m.shape
    Qb, Kb = -(-L // block), -(-C // block)
    mp = torch.zeros(b, h, Qb * block, Kb * block, dtype=torch.int32)
    mp[..., :L, :C] = m
    s = mp.view(b, h, Qb, block, Kb, block).sum((3, 5))
    return (s > 0) & (s < block * block), s == block * block


def random_mask_case(gen: random.Random):
    S = gen.choice([1, 5, 16, 33, 64, 100, 130])
    return S, gen.randint(0, 4), gen.randint(1, 20), gen.randint(0, S), gen.choice([4, 8, 16, 128])


def test_sparse_flags_match_dense_running_topk():
    gen = random.Random(0)
    for _ in range(40):
        S, s, w, k, block = random_mask_case(gen)
        rt = running_topk(torch.randn(2, 3, S), s, w, k, backend="torch")
        ref = flags_of_dense(sparse_mask_reference(rt, s, w), block)
        got = sparse_block_flags(rt.rank, rt.cutoff, s, w, block, max_tile_elems=gen.choice([1, 1000, 1 << 22]))
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), (S, s, w, k, block)


def test_sparse_flags_match_dense_arbitrary_cutoff():
    """No monotonicity of cutoff is assumed."""
    gen = random.Random(1)
    for _ in range(40):
        S, s, w, _, block = random_mask_case(gen)
        cut = torch.randint(-1, S + 1, (2, 3, S))
        rank = torch.randint(-1, S, (2, 3, S))
        t = torch.arange(S)
        q = t[:, None]
        m = (t <= q) & ((t < s) | (q - t < w) | ((t >= s) & (t <= q - w) & (rank[..., None, :] <= cut[..., :, None])))
        ref = flags_of_dense(m, block)
        got = sparse_block_flags(rank, cut, s, w, block, max_tile_elems=gen.choice([1, 1000, 1 << 22]))
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), (S, s, w, block)


def test_future_flags_match_dense():
    for S in (1, 7, 16, 50, 129):
        for w in (1, 3, 16, 60, 200):
            for block in (4, 16, 128):
                t = torch.arange(S)
                m = (t[None, :] >= t[:, None] + w)[None, None]
                ref = flags_of_dense(m, block)
                got = future_block_flags(S, w, "cpu", block)
                assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), (S, w, block)


def test_simplified_mask_mod_equals_reference():
    gen = random.Random(2)
    for _ in range(20):
        S, s, w, k, _ = random_mask_case(gen)
        rt = running_topk(torch.randn(1, 2, S), s, w, k, backend="torch")
        kv_mod, mod = sparse_mask_mods(rt, s, w, groups=2)
        qi = torch.arange(S).view(1, 1, S, 1)
        ki = torch.arange(S).view(1, 1, 1, S)
        got = kv_mod(torch.zeros(1, 1, 1, 1, dtype=torch.long), torch.arange(2).view(1, 2, 1, 1), qi, ki)
        assert torch.equal(got.expand(1, 2, S, S), sparse_mask_reference(rt, s, w))
        got_q = mod(torch.zeros(1, 1, 1, 1, dtype=torch.long), torch.arange(4).view(1, 4, 1, 1), qi, ki)
        assert torch.equal(got_q.expand(1, 4, S, S), sparse_mask_reference(rt, s, w).repeat_interleave(2, 1))


def _same_blocks(a, b):
    for f in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    for f, n in (("kv_indices", "kv_num_blocks"), ("full_kv_indices", "full_kv_num_blocks")):
        x, y, num = getattr(a, f), getattr(b, f), getattr(a, n)
        live = torch.arange(x.shape[-1]) < num[..., None]
        assert torch.equal(torch.where(live, x, -1), torch.where(live, y, -1)), f


@pytest.mark.parametrize("S,s,w,k", [(300, 4, 16, 40), (257, 0, 1, 0), (256, 2, 64, 300), (129, 4, 256, 3)])
def test_sparse_block_mask_equals_tiled_and_create_block_mask(S, s, w, k):
    rt = running_topk(torch.randn(1, 2, S, generator=torch.Generator().manual_seed(S)), s, w, k, backend="torch")
    a = sparse_attention_block_mask(rt, s, w, 2, method="analytic")
    _same_blocks(a, sparse_attention_block_mask(rt, s, w, 2, method="tiled"))
    _, mod = sparse_mask_mods(rt, s, w, 2)
    _same_blocks(a, create_block_mask(mod, 1, 4, S, S, device="cpu"))


@pytest.mark.parametrize("S,w", [(300, 16), (256, 128), (129, 1), (100, 200)])
def test_future_block_mask_equals_create_block_mask(S, w):
    _same_blocks(future_block_mask_for(S, w, "cpu"), create_block_mask(future_mask_mod(w), None, None, S, S,
                                                                       device="cpu"))
