"""The interval form of a chunk's visibility (kvpop_hf/ops/interval_mask.py): equal to ChunkPlan.visibility() in
plan order and after the sorted layout; its block flags cover every visible entry and mark as full only whole
visible blocks; FlexAttention over the reordered keys equals dense SDPA with the plan's mask."""

import random
import warnings

import pytest
import torch
from torch.nn import functional as F

from kvpop_hf.ops.interval_mask import (interval_block_flags, interval_block_mask, interval_chunk_mask, interval_layout,
                                    interval_visibility)
from test_flex_chunk_attention import random_plan

pytestmark = pytest.mark.tier("unit")

warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")


@pytest.mark.parametrize("holes", [False, True, "attend"])
def test_intervals_equal_visibility_in_plan_order_and_in_the_layout(holes):
    gen = random.Random(21 + bool(holes))
    for trial in range(150):
        plan = random_plan(gen, max_len=gen.choice([16, 70]), holes=holes)
        vis = plan.visibility()
        im = interval_chunk_mask(plan.compact())
        assert torch.equal(interval_visibility(im), vis), trial
        for segment in (1, 3, 16, 1024):
            lay = interval_layout(im, segment)
            assert torch.equal(lay.perm.sort(-1).values, torch.arange(vis.shape[-1]).expand_as(lay.perm))
            moved = vis.gather(-1, lay.perm[:, :, None, :].expand_as(vis))
            assert torch.equal(interval_visibility(lay), moved), (trial, segment)


@pytest.mark.parametrize("holes", [False, True, "attend"])
def test_interval_block_flags_cover_the_mask_and_full_blocks_are_whole(holes):
    gen = random.Random(31 + bool(holes))
    for trial in range(60):
        plan = random_plan(gen, b=2, h=2, max_len=gen.choice([16, 70]), holes=holes)
        lay = interval_layout(interval_chunk_mask(plan.compact()), segment=gen.choice([2, 8, 64]))
        vis = interval_visibility(lay)
        b, h, L, C = vis.shape
        for block in (1, 4, 16):
            partial, full = interval_block_flags(lay, block)
            assert not (partial & full).any()
            dense = torch.zeros(b, h, -(-L // block) * block, -(-C // block) * block, dtype=torch.bool)
            dense[..., :L, :C] = vis
            blocks = dense.view(b, h, -(-L // block), block, -(-C // block), block)
            assert not (blocks.any(3).any(-1) & ~(partial | full)).any(), (trial, block)  # nothing visible skipped
            complete = torch.zeros_like(dense)
            complete[..., :L, :C] = True
            whole = (blocks.all(3).all(-1) & complete.view_as(blocks).all(3).all(-1))
            assert not (full & ~whole).any(), (trial, block)  # full only where every entry is seen
            assert not (whole & ~full & (plan.query_pos >= 0).all()).any() or block == 1, (trial, block)


def test_the_layout_makes_a_long_chunk_sparse():
    """A 1024-token chunk over 256 stored slots, B = 4 + 32 + 220: the layout visits far fewer blocks."""
    torch.manual_seed(0)
    s, w, k = 4, 32, 220
    B, L = s + w + k, 1024
    from kvpop_hf.layer import ChunkPlan

    pos = torch.cat([torch.arange(s), torch.arange(10 * B - w, 10 * B), torch.randperm(10 * B - w - s)[:k] + s,
                     10 * B + torch.arange(L)]).view(1, 1, -1)
    C = pos.shape[-1]
    order = torch.randperm(C).view(1, 1, C)
    qpos = (10 * B + torch.arange(L)).view(1, L)
    plan = ChunkPlan(None, None, pos, order, qpos, s, w, k)
    im = interval_chunk_mask(plan.compact())
    block = 64
    visited = lambda m: sum(int(x.sum()) for x in interval_block_flags(m, block))  # noqa: E731
    plain, sorted_ = visited(im), visited(interval_layout(im, segment=256))
    assert sorted_ < 0.6 * plain, (plain, sorted_)
    assert interval_visibility(im).sum(-1).max() <= B  # each query sees at most B keys


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_over_the_layout_matches_dense_mask(dtype):
    from torch.nn.attention.flex_attention import flex_attention

    gen = random.Random(7)
    g = torch.Generator().manual_seed(7)
    for _ in range(6):
        plan = random_plan(gen, b=2, h=2, d=16, max_len=40, holes=True)
        b, h, C, d = plan.keys.shape
        L, groups = plan.query_pos.shape[1], 3
        q = torch.randn(b, h * groups, L, d, generator=g).to(dtype)
        k, v = plan.keys.to(dtype), torch.randn(b, h, C, 12, generator=g).to(dtype)
        lay = interval_layout(interval_chunk_mask(plan.compact()), segment=8)
        kk = k.gather(2, lay.perm[..., None].expand(b, h, C, d))
        vv = v.gather(2, lay.perm[..., None].expand(b, h, C, 12))
        out = flex_attention(q, kk, vv, block_mask=interval_block_mask(lay, groups, block=16), scale=0.3,
                             enable_gqa=True)
        mask = plan.visibility().repeat_interleave(groups, dim=1)
        ref = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(groups, 1),
                                             v.float().repeat_interleave(groups, 1), attn_mask=mask, scale=0.3)
        real = (plan.query_pos >= 0)[:, None, :, None]
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(torch.where(real, out.float(), 0), torch.where(real, ref, 0), atol=tol, rtol=0)
