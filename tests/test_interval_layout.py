"""The interval layout of the training sparse attention: the intervals are the running top-k mask, the block
flags cover it exactly where it is (full blocks all visible, every visible entry in a visited block), and
FlexAttention over the reordered keys equals the materialised-mask reference (forward here; the gradients on
CUDA in tests/gpu/test_interval_layout_cuda.py, FlexAttention has no CPU backward)."""

import random
import warnings

import pytest
import torch

from kvpop_hf.ops.running_topk import running_topk, sparse_mask_reference
from kvpop_hf.trainer import KVpopTrainingArguments
from kvpop_hf.trainer.interval_layout import default_segment, interval_sparse_layout, sequence_intervals
from kvpop_hf.trainer.sparse_attention import sparse_attention, sparse_attention_block_mask, sparse_attention_reference

pytestmark = pytest.mark.tier("unit")

warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")


def cases(n, seed):
    gen = random.Random(seed)
    for _ in range(n):
        S = gen.choice([1, 7, 33, 130, 300, 517])
        yield S, gen.randint(0, 5), gen.randint(1, 40), gen.randint(0, S), gen.randint(0, 10**6)


def test_intervals_are_the_running_topk_mask():
    for S, s, w, k, seed in cases(60, 0):
        prio = torch.randn(2, 3, S, generator=torch.Generator().manual_seed(seed))
        if seed % 3 == 0:  # ties
            prio = prio.round()
        rt = running_topk(prio, s, w, k, backend="torch")
        start, end = sequence_intervals(rt, s, w)
        q = torch.arange(S).view(S, 1)
        got = (start[..., None, :] <= q) & (q < end[..., None, :])
        assert torch.equal(got, sparse_mask_reference(rt, s, w)), (S, s, w, k)


@pytest.mark.parametrize("segment", [None, 16, 64])
def test_block_flags_cover_the_reordered_mask(segment):
    block = 16
    for S, s, w, k, seed in cases(30, 1):
        rt = running_topk(torch.randn(1, 2, S, generator=torch.Generator().manual_seed(seed)), s, w, k, backend="torch")
        lay = interval_sparse_layout(rt, s, w, groups=1, segment=segment, block=block)
        # the reference mask with its keys in the layout's order
        dense = sparse_mask_reference(rt, s, w).gather(-1, lay.perm[:, :, None, :].expand(1, 2, S, S))
        q = torch.arange(S).view(S, 1)
        assert torch.equal((lay.start[..., None, :] <= q) & (q < lay.end[..., None, :]), dense)
        nb = -(-S // block)
        padded = torch.zeros(1, 2, nb * block, nb * block, dtype=torch.int32)
        padded[..., :S, :S] = dense
        count = padded.view(1, 2, nb, block, nb, block).sum((3, 5))
        bm = lay.block_mask
        visited = torch.zeros(1, 2, nb, nb, dtype=torch.bool)
        full = torch.zeros_like(visited)
        for qb in range(nb):
            visited[..., qb, :].scatter_(-1, bm.kv_indices[..., qb, :].long(), 
                                         torch.arange(nb).expand(1, 2, nb) < bm.kv_num_blocks[..., qb, None])
            full[..., qb, :].scatter_(-1, bm.full_kv_indices[..., qb, :].long(),
                                      torch.arange(nb).expand(1, 2, nb) < bm.full_kv_num_blocks[..., qb, None])
        assert not (visited & full).any()
        assert (count[full] == block * block).all(), "a full block must be visible everywhere"
        assert not ((count > 0) & ~visited & ~full).any(), "a block with a visible entry must be visited"


@pytest.mark.parametrize("S,s,w,k", [(300, 4, 16, 40), (700, 4, 32, 100), (129, 0, 200, 3), (520, 2, 8, 0)])
def test_flex_over_the_interval_layout_equals_the_reference(S, s, w, k):
    g = torch.Generator().manual_seed(S)
    rt = running_topk(torch.randn(2, 2, S, generator=g), s, w, k, backend="torch")
    q = torch.randn(2, 6, S, 16, generator=g)
    key, value = torch.randn(2, 2, S, 16, generator=g), torch.randn(2, 2, S, 16, generator=g)
    ref_out, ref_lse = sparse_attention_reference(q, key, value, rt, s, w)
    for layout in (None, sparse_attention_block_mask(rt, s, w, 3, method="interval"),
                   interval_sparse_layout(rt, s, w, 3, segment=64)):
        out, lse = sparse_attention(q, key, value, rt, s, w, block_mask=layout)
        torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)


def test_default_segment():
    assert [default_segment(n) for n in (8192, 32768, 131072)] == [1024, 2048, 4096]
    assert default_segment(1) == 256 and default_segment(1 << 30) == 8192


def test_unknown_layout_is_refused(tmp_path):
    refused = r"Backends\(_train_block_mask=...\) must be one of \('interval', 'analytic'\)"
    with pytest.raises(ValueError, match=refused):
        KVpopTrainingArguments(output_dir=str(tmp_path), sinks=2, window=4, topk=4, scorer="mlp",
                               backends={"_train_block_mask": "sorted"})
