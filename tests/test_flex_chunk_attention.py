"""FlexAttention path for multi-token chunks: compact cutoff tensors == ChunkPlan.visibility(), and the
flex path (forced on CPU, eager) gives the same logits as the dense SDPA-mask path and the reference."""

import random
import warnings

import pytest
import torch
from torch.nn import functional as F

from helpers import distinct_ids, left_padded, reference_logits, run_chunks, run_whole, tiny_model
from kvpop_hf import KVpopCache
from kvpop_hf.ops.chunk_attention import flex_chunk_attention as _flex_chunk_attention
from kvpop_hf.compat import with_cache
from kvpop_hf.ops.flex_mask import chunk_cutoff, chunk_cutoff_reference, dense_from_compact
from kvpop_hf.layer import ChunkPlan, attending_positions

pytestmark = pytest.mark.tier("unit")

S, W, K = 2, 5, 6

warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")


# ---------------------------------------------------------------- compact mask == visibility()
def random_plan(gen: random.Random, b=2, h=3, d=8, max_len=16, holes=False):
    """A chunk plan with random stored positions, left padding (or, with ``holes``, padding anywhere; with
    ``holes="attend"`` also the query positions the layer hands over, where padding after a real query attends
    as that query: :func:`kvpop_hf.layer.attending_positions`)."""
    s, w, k = gen.randint(0, 3), gen.randint(1, 6), gen.choice([0, 1, 2, 5, 9])
    n_old, L = gen.randint(0, 20), gen.randint(1, max_len)
    C = n_old + L
    pos = torch.full((b, h, C), -1, dtype=torch.long)
    qpos = torch.full((b, L), -1, dtype=torch.long)
    for bi in range(b):
        seen = gen.randint(n_old, 3 * n_old + 1)
        n_pad = gen.randint(0, L)  # left padding, possibly the whole chunk
        real = list(range(n_pad, L)) if not holes else sorted(gen.sample(range(L), L - n_pad))
        qpos[bi, real] = seen + torch.arange(L - n_pad)
        pos[bi, :, n_old:] = qpos[bi]
        for hi in range(h):
            stored = gen.sample(range(seen), min(n_old, seen))
            stored += [-1] * (n_old - len(stored))
            gen.shuffle(stored)
            pos[bi, hi, :n_old] = torch.tensor(stored, dtype=torch.long)
    g = torch.Generator().manual_seed(gen.randint(0, 10**6))
    order = torch.stack([torch.randperm(C, generator=g) for _ in range(b * h)]).view(b, h, C)
    kv = torch.randn(b, h, C, d, generator=g)
    return ChunkPlan(kv, kv.clone(), pos, order, attending_positions(qpos) if holes == "attend" else qpos, s, w, k)


@pytest.mark.parametrize("holes", [False, "attend"])
def test_compact_cutoff_equals_visibility(holes):
    gen = random.Random(0)
    for _ in range(120):
        plan = random_plan(gen, holes=holes)
        args = (plan.pos, plan.order, plan.query_pos, plan.sinks, plan.window, plan.topk)
        ref = chunk_cutoff_reference(*args)
        assert torch.equal(chunk_cutoff(*args), ref)
        vis = plan.visibility()
        for reference in (False, True):
            cm = plan.compact(reference=reference)
            assert torch.equal(cm.cutoff, ref)
            assert torch.equal(dense_from_compact(cm), vis)
        # the query-head mapping h -> h // G
        cm = plan.compact()
        assert torch.equal(dense_from_compact(cm, groups=2), vis.repeat_interleave(2, dim=1))


@pytest.mark.parametrize("holes", [False, True, "attend"])
def test_blocked_cutoff_equals_reference_and_running_topk(holes):
    """The parallel blocked cutoff == the O(L*C) count == the sequential running top-k, for block sizes
    smaller and larger than the chunk and any tiling."""
    from kvpop_hf.ops.flex_mask import blocked_chunk_cutoff

    gen = random.Random(5 + bool(holes))
    for trial in range(60):
        plan = random_plan(gen, max_len=gen.choice([16, 70]), holes=holes)
        args = (plan.pos, plan.order, plan.query_pos, plan.sinks, plan.window, plan.topk)
        ref = chunk_cutoff_reference(*args)
        assert torch.equal(chunk_cutoff(*args, backend="torch"), ref)
        for block, tile in ((1, 1 << 25), (3, 1), (8, 5000), (128, 1 << 25)):
            assert torch.equal(blocked_chunk_cutoff(*args, block=block, max_tile_elems=tile), ref), (trial, block)


def test_compact_cutoff_triton_backend():
    """The CUDA adapter path (Fenwick Triton kernel), through the Triton interpreter on CPU."""
    pytest.importorskip("triton")
    from kvpop_hf.ops.running_topk import fenwick_triton

    if not fenwick_triton._is_interpreted():
        pytest.skip("needs TRITON_INTERPRET=1 before the first import (tests/conftest.py sets it)")
    gen = random.Random(2)
    for _ in range(5):
        plan = random_plan(gen)
        args = (plan.pos, plan.order, plan.query_pos, plan.sinks, plan.window, plan.topk)
        assert torch.equal(chunk_cutoff(*args, backend="triton"), chunk_cutoff_reference(*args))


def test_cutoff_special_values():
    # k == 0 -> -1; fewer than k eligible -> C
    pos = torch.arange(6).view(1, 1, 6)
    order = torch.arange(6).view(1, 1, 6)
    qpos = torch.tensor([[3, 4, 5]])
    assert chunk_cutoff(pos, order, qpos, 0, 2, 0).eq(-1).all()
    cut = chunk_cutoff(pos, order, qpos, 0, 2, 3)  # eligible at q: 0..q-2 -> 2, 3, 4 tokens
    assert cut.tolist() == [[[6, 2, 2]]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("holes", [False, "attend"])
def test_flex_chunk_attention_matches_dense_mask(dtype, holes):
    gen = random.Random(1)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        plan = random_plan(gen, b=2, h=2, d=16, holes=holes)
        b, h, C, d = plan.keys.shape
        L = plan.query_pos.shape[1]
        groups = 3
        q = torch.randn(b, h * groups, L, d, generator=g).to(dtype)
        k, v = plan.keys.to(dtype), torch.randn(b, h, C, 12, generator=g).to(dtype)
        scale = 0.37
        out = _flex_chunk_attention(plan, q, k, v, scale)  # [b, L, Hq, dv]
        mask = plan.visibility().repeat_interleave(groups, dim=1)
        ref = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(groups, 1),
                                             v.float().repeat_interleave(groups, 1), attn_mask=mask, scale=scale)
        assert out.dtype == dtype and out.shape == (b, L, h * groups, 12)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), ref.transpose(1, 2), atol=tol, rtol=0)


# ---------------------------------------------------------------- whole models: flex == dense == reference
@pytest.mark.parametrize("scorer", ["knorm", "mlp", "mlstm"])
def test_flex_logits_match_dense_and_reference(scorer):
    model = tiny_model("qwen3")  # 4 query heads over 2 KV heads
    ids = distinct_ids(2, 40, seed=1)
    make = lambda mode="dense": KVpopCache(model.config, sinks=S, window=W, topk=K, scorer=scorer,  # noqa: E731
                                           log_gamma=-0.7, decay_step=4, backends={"chunk_attention": mode})
    ref, _ = reference_logits(model, ids, make().scorer, S, W, K, make().log_gamma, 4)
    for feed in (run_whole, run_chunks):
        dense = feed(model, ids, make("dense"))
        flex = feed(model, ids, make("flex"))
        torch.testing.assert_close(flex, dense, atol=1e-5, rtol=0)
        torch.testing.assert_close(flex, ref, atol=2e-5, rtol=0)


@pytest.mark.parametrize("scorer", ["knorm", "mlstm"])
def test_flex_left_padding_with_prefill_chunks(scorer):
    model = tiny_model("llama")
    rows = [distinct_ids(1, n, seed=n)[0] for n in (30, 21, 26)]
    ids, mask, width = left_padded(rows)
    kw = dict(sinks=2, window=6, topk=8, scorer=scorer)
    gen = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    outs = {}
    for mode, chunk in (("dense", 7), ("flex", 7), ("flex", None)):
        extra = {} if chunk is None else {"prefill_chunk_size": chunk}
        cache = KVpopCache(model.config, **kw, backends={"chunk_attention": mode})
        outs[mode, chunk] = model.generate(ids, attention_mask=mask, **with_cache(model, cache), **gen, **extra)
    base = outs["dense", 7]
    for key, out in outs.items():
        assert torch.equal(out.sequences, base.sequences), key
        for a, b in zip(out.logits, base.logits):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=0)
    # a padded row equals the unpadded row run alone (through the flex path)
    i, r = 1, rows[1]
    cache = KVpopCache(model.config, **kw, backends={"chunk_attention": "flex"})
    single = model.generate(r[None], **with_cache(model, cache), **gen, prefill_chunk_size=7)
    for a, b in zip(outs["flex", 7].logits, single.logits):
        torch.testing.assert_close(a[i], b[0], atol=2e-5, rtol=0)


def test_chunk_block_mask_equals_create_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    from kvpop_hf.ops.flex_mask import build_block_mask

    gen = random.Random(3)
    for trial in range(6):
        plan = random_plan(gen, b=2, h=2)
        if trial % 2:  # longer chunks: several blocks of 16
            plan = random_plan(gen, b=1, h=2)
        cm = plan.compact()
        L, C = plan.query_pos.shape[1], plan.pos.shape[-1]
        for groups, block in ((1, 8), (3, 4), (2, 128)):
            ours = build_block_mask(cm, groups, block=block)
            ref = create_block_mask(cm.mask_mod(groups), plan.pos.shape[0], 2 * groups, L, C, device="cpu",
                                    BLOCK_SIZE=block)
            assert torch.equal(ours.to_dense(), ref.to_dense())
            for a, b in ((ours.full_kv_num_blocks, ref.full_kv_num_blocks), (ours.kv_num_blocks, ref.kv_num_blocks)):
                assert torch.equal(a.long(), b.long())


@pytest.mark.parametrize("holes", [False, True, "attend"])
def test_chunk_block_flags_equal_the_dense_mask_blocks(holes):
    """Analytic per-block flags == the blocks of the evaluated mask (tile-by-tile builder), any tiling."""
    from kvpop_hf.ops.flex_mask import chunk_block_flags, tiled_block_mask

    gen = random.Random(11 + bool(holes))
    for trial in range(40):
        plan = random_plan(gen, b=2, h=2, max_len=gen.choice([16, 70]), holes=holes)
        cm = plan.compact(reference=True)
        b, h, C = plan.pos.shape
        L = plan.query_pos.shape[1]
        for block in (1, 4, 16):
            ref = tiled_block_mask(cm.mask_mod(1), b, h, L, C, 1, cm.mask_mod(1), "cpu", block=block)
            ref_partial, ref_full = ref.kv_num_blocks, ref.full_kv_num_blocks
            for tile in (1, 100, 1 << 25):
                partial, full = chunk_block_flags(cm, block, max_tile_elems=tile)
                assert torch.equal(partial.sum(-1).int(), ref_partial.int()), (trial, block, tile)
                assert torch.equal(full.sum(-1).int(), ref_full.int()), (trial, block, tile)
                dense = torch.zeros(b, h, -(-L // block) * block, -(-C // block) * block, dtype=torch.bool)
                dense[..., :L, :C] = dense_from_compact(cm)
                blocks = dense.view(b, h, -(-L // block), block, -(-C // block), block)
                assert torch.equal(partial | full, blocks.any(3).any(-1)), (trial, block, tile)
                assert torch.equal(full[..., :L // block, :C // block],
                                   blocks.all(3).all(-1)[..., :L // block, :C // block]), (trial, block, tile)
