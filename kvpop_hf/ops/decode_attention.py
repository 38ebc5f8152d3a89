"""Attention of one decode step over the ``B`` fixed slots, split along the slots.

Per row, slot ``i`` is visible iff ``i < seen[row]`` (the occupied slots are a prefix; see
``docs/design.md`` section 3). The ``G = Hq / Hkv`` query heads of a KV head share its keys, so both
versions read every key and value once per KV head and never expand them.

* :func:`decode_attention_reference` -- plain torch: the ``G`` heads as ``G`` queries of one SDPA call
  with a ``[b, 1, 1, B]`` mask. Obviously right, but on a GPU it runs ``b * Hkv`` programs (8 for a
  Qwen3-8B row) over 4096 slots, far from filling the device.
* :func:`decode_attention_triton` -- split-KV ("flash-decoding"): program ``(row, KV head, split)``
  computes the softmax statistics of its share of the slots for all ``G`` heads (running max ``m``,
  sum ``l``, unnormalised output ``acc``), then the splits are merged:
  ``out = sum_s e^{m_s - M} acc_s / sum_s e^{m_s - M} l_s`` with ``M = max_s m_s``.

:func:`decode_attention_for` gives the one a layer's ``Backends.decode_attention`` names (the Triton version is
the CUDA default, docs/backends.md); tests compare the two on random inputs (``TRITON_INTERPRET=1`` on CPU).

Shapes: query ``[b, Hq, 1, d]``, key ``[b, Hkv, B, d]``, value ``[b, Hkv, B, dv]``, seen ``[b]`` int64
-> ``[b, 1, Hq, dv]`` in the query's dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .kernels import lazy_kernel, next_pow2

__all__ = ["decode_attention_for", "decode_attention_reference", "decode_attention_triton", "split_count",
           "split_decode_kernel"]


def decode_attention_reference(query, key, value, seen, scaling):
    """One SDPA call with the ``G`` query heads of a KV head as its queries and a ``slot < seen`` mask."""
    b, hq, _, d = query.shape
    hkv, B = key.shape[1], key.shape[2]
    mask = (torch.arange(B, device=key.device) < seen[:, None]).view(b, 1, 1, B)
    q = query.reshape(b, hkv, hq // hkv, d)
    out = F.scaled_dot_product_attention(q, key.to(query.dtype), value.to(query.dtype), attn_mask=mask, scale=scaling)
    return out.reshape(b, 1, hq, value.shape[-1])


@lazy_kernel("decode_attention_triton (Backends.decode_attention='triton')",
             hint="; or choose Backends(decode_attention='torch') (KVPOP_DECODE_ATTENTION=torch)")
def split_decode_kernel(triton, tl):
    """The split-KV Triton kernel, defined on the first call (importing this module does not import triton);
    ImportError naming the fix without triton."""

    @triton.jit
    def _split_decode(q, k, v, seen, m_out, l_out, acc_out, scale_log2, H, B, SPLIT,
                      G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, NS: tl.constexpr,
                      BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_DV: tl.constexpr):
        row = tl.program_id(0)  # batch * H + KV head
        split = tl.program_id(1)
        t = tl.load(seen + row // H)
        start = split * SPLIT
        stop = tl.minimum(start + SPLIT, tl.minimum(t, B))
        og = tl.arange(0, BLOCK_G)
        od = tl.arange(0, BLOCK_D)
        odv = tl.arange(0, BLOCK_DV)
        on = tl.arange(0, BLOCK_N)
        mg = og < G
        qs = tl.load(q + (row.to(tl.int64) * G + og[:, None]) * D + od[None, :], mask=mg[:, None] & (od[None, :] < D),
                     other=0.0)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
        base = row.to(tl.int64) * B
        for n0 in range(start, stop, BLOCK_N):
            n = n0 + on
            mn = n < stop
            ks = tl.load(k + (base + n[:, None]) * D + od[None, :], mask=mn[:, None] & (od[None, :] < D), other=0.0)
            vs = tl.load(v + (base + n[:, None]) * DV + odv[None, :], mask=mn[:, None] & (odv[None, :] < DV),
                         other=0.0)
            # compiled callers may pass the scale as float64: keep the scores float32
            s = (tl.dot(qs, tl.trans(ks.to(qs.dtype))).to(tl.float32) * scale_log2).to(tl.float32)
            s = tl.where(mn[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(qs.dtype), vs.to(qs.dtype)).to(tl.float32)
            m_i = m_new
        stat = (row.to(tl.int64) * NS + split) * G + og
        tl.store(m_out + stat, m_i, mask=mg)
        tl.store(l_out + stat, l_i, mask=mg)
        tl.store(acc_out + stat[:, None] * DV + odv[None, :], acc, mask=mg[:, None] & (odv[None, :] < DV))

    return _split_decode


_BLOCK_N = 64
_PROGRAMS = 256  # about two per multiprocessor of an H100/H200 (132); from shapes only, so traceable


def split_count(programs: int, slots: int, block: int = _BLOCK_N, target: int = _PROGRAMS) -> tuple[int, int]:
    """``(number of splits, slots per split)`` so that ``programs * splits`` is about ``target``, each split a
    whole number of ``block``-slot tiles. ``programs = batch * Hkv``; depends on shapes only (a compiled
    decode step bakes it in)."""
    tiles = max(1, math.ceil(slots / block))
    want = max(1, math.ceil(target / max(programs, 1)))
    per_split = math.ceil(tiles / min(tiles, want)) * block
    return math.ceil(slots / per_split), per_split


def decode_attention_triton(query, key, value, seen, scaling, splits: int | None = None, block_n: int = _BLOCK_N,
                            num_warps: int | None = None, num_stages: int | None = None):
    """Split-KV version of :func:`decode_attention_reference`; ``splits`` overrides the split count, ``block_n``
    (slots per tile), ``num_warps`` and ``num_stages`` the launch configuration
    (``benchmarks/decode_attention_configs.py`` times them)."""
    b, hq, _, d = query.shape
    hkv, B, dv = key.shape[1], key.shape[2], value.shape[-1]
    g = hq // hkv
    if not (key.is_contiguous() and value.is_contiguous()):
        raise ValueError("decode_attention_triton needs contiguous key/value buffers")
    ns, per_split = split_count(b * hkv, B, block_n, target=_PROGRAMS if splits is None else b * hkv * splits)
    launch = {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None}
    q = query.reshape(b * hkv, g, d).contiguous()
    m = torch.empty(b * hkv, ns, g, device=query.device, dtype=torch.float32)
    l = torch.empty_like(m)
    acc = torch.empty(b * hkv, ns, g, dv, device=query.device, dtype=torch.float32)
    scale = (1.0 / math.sqrt(d)) if scaling is None else float(scaling)
    split_decode_kernel()[(b * hkv, ns)](q, key, value, seen, m, l, acc, scale * math.log2(math.e), hkv, B, per_split,
                                         G=g, D=d, DV=dv, NS=ns, BLOCK_G=max(16, next_pow2(g)), BLOCK_N=block_n,
                                         BLOCK_D=next_pow2(d), BLOCK_DV=next_pow2(dv), **launch)
    # merge the splits; a split past `seen` has m = -inf and l = acc = 0
    top = m.amax(dim=1, keepdim=True)
    w = torch.exp2(m - top)
    out = (w[..., None] * acc).sum(1) / (w * l).sum(1)[..., None]
    return out.to(query.dtype).reshape(b, 1, hq, dv)


def decode_attention_for(choice: str):
    """The decode attention a resolved ``Backends.decode_attention`` names: ``"triton"`` (split-KV) or ``"torch"``
    (the reference). Chosen once per layer, so decode steps never read the environment; the kernel is defined now,
    outside any compiled decode step."""
    if choice == "triton":
        split_decode_kernel()
    return {"triton": decode_attention_triton, "torch": decode_attention_reference}[choice]
