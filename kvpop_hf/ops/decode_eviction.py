"""The eviction of one decode step, fused: write the new token into its slot and, if the token it
displaces leaves the window and beats the weakest long-range slot, move it there.

Slot layout and contract: :mod:`kvpop_hf.layer` and ``docs/design.md``. Per (batch row, KV head),
with ``t = seen[row]`` the real position of the new token:

1. ``slot = t`` for ``t < s + w`` else ``s + (t - s) % w``; the token stored there (position
   ``pos[slot]``) leaves the window when ``t - w >= s`` and ``pos[slot] >= s``;
2. the weakest long-range slot is the one of lowest priority, ties to the older (smaller) position,
   then to the lower slot index (empty slots have priority -inf and position -1, so they fill first,
   in slot order);
3. the leaving token replaces it if its priority ``p_leave >= `` the weakest one (ties to the newer);
4. the new token takes ``slot`` with priority ``p_new`` (``-inf`` under delayed scoring).

:func:`evict_and_insert_reference` is the plain torch version (about twenty launches per layer);
:func:`evict_and_insert_triton` does it in one Triton program per (row, KV head), and is what
:func:`eviction_for` picks on CUDA. Tests compare the two on random states (``TRITON_INTERPRET=1``
on CPU). All tensors are updated in place, so CUDA graphs can replay the step.

Shapes: keys ``[b, h, B, d]``, values ``[b, h, B, dv]``, pos ``[b, h, B]`` int64 (-1 empty), prio
``[b, h, B]`` float32, seen ``[b]`` int64, k_new ``[b, h, d]``, v_new ``[b, h, dv]``, p_leave/p_new
``[b, h]`` float32.
"""

from __future__ import annotations

import torch

from .kernels import lazy_kernel, next_pow2

__all__ = ["eviction_for", "evict_and_insert_reference", "evict_and_insert_triton", "evict_insert_kernel", "read_entry",
           "ring_slot", "slot_entry"]

NEG_INF = float("-inf")


def ring_slot(t: torch.Tensor, sinks: int, window: int) -> torch.Tensor:
    """The slot of the token at real position ``t`` while it is a sink or in the window."""
    return torch.where(t < sinks, t, sinks + torch.remainder(t - sinks, window))


def slot_entry(keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor, slot: torch.Tensor):
    """The entry stored at ``slot [b, h, 1]`` of each (row, KV head): (pos ``[b, h, 1]``, key ``[b, h, 1, d]``,
    value ``[b, h, 1, dv]``)."""
    b, h = slot.shape[:2]
    return (pos.gather(2, slot), keys.gather(2, slot[..., None].expand(b, h, 1, keys.shape[-1])),
            values.gather(2, slot[..., None].expand(b, h, 1, values.shape[-1])))


def read_entry(keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor, seen: torch.Tensor, k_new: torch.Tensor,
               v_new: torch.Tensor, sinks: int, window: int, read_new: bool):
    """The token a decode step scores: the new one at position ``seen [b]`` (``read_new``, a scorer read at
    entry) or, with delayed scoring, the one about to leave the window from the slot ``seen`` will take.
    Returns (pos ``[b, h, 1]``, key ``[b, h, 1, d]``, value ``[b, h, 1, dv]``)."""
    b, h = k_new.shape[:2]
    if read_new:
        return seen.view(b, 1, 1).expand(b, h, 1), k_new, v_new
    return slot_entry(keys, values, pos, ring_slot(seen, sinks, window).view(b, 1, 1).expand(b, h, 1))


def evict_and_insert_reference(keys, values, pos, prio, seen, k_new, v_new, p_leave, p_new,
                               sinks: int, window: int, topk: int) -> None:
    s, w = sinks, window
    b, h, _, d = keys.shape
    dv = values.shape[-1]
    t = seen
    slot = ring_slot(t, s, w).view(b, 1, 1).expand(b, h, 1)
    k_idx, v_idx = slot[..., None].expand(b, h, 1, d), slot[..., None].expand(b, h, 1, dv)
    leaving_pos = pos.gather(2, slot)
    p_leave = p_leave.view(b, h, 1)
    if topk > 0:
        k_leave, v_leave = keys.gather(2, k_idx), values.gather(2, v_idx)
        leaving = (t - w >= s).view(b, 1, 1) & (leaving_pos >= s)
        lo = s + w
        prio_tk, pos_tk = prio[:, :, lo:], pos[:, :, lo:]
        weakest_p = prio_tk.min(-1, keepdim=True).values
        older_first = torch.where(prio_tk == weakest_p, pos_tk, torch.iinfo(torch.long).max)
        dest = older_first.argmin(-1, keepdim=True) + lo  # [b,h,1]; argmin takes the lowest slot on ties
        replace = leaving & (p_leave >= weakest_p)
        dest_k, dest_v = dest[..., None].expand(b, h, 1, d), dest[..., None].expand(b, h, 1, dv)
        keys.scatter_(2, dest_k, torch.where(replace[..., None], k_leave, keys.gather(2, dest_k)))
        values.scatter_(2, dest_v, torch.where(replace[..., None], v_leave, values.gather(2, dest_v)))
        pos.scatter_(2, dest, torch.where(replace, leaving_pos, pos.gather(2, dest)))
        prio.scatter_(2, dest, torch.where(replace, p_leave, prio.gather(2, dest)))
    keys.scatter_(2, k_idx, k_new.view(b, h, 1, d).to(keys.dtype))
    values.scatter_(2, v_idx, v_new.view(b, h, 1, dv).to(values.dtype))
    pos.scatter_(2, slot, t.view(b, 1, 1).expand(b, h, 1))
    prio.scatter_(2, slot, p_new.view(b, h, 1).float())


@lazy_kernel("evict_and_insert_triton (Backends.decode_eviction='triton')",
             hint="; or choose Backends(decode_eviction='torch') (KVPOP_DECODE_EVICTION=torch)")
def evict_insert_kernel(triton, tl):
    """The fused eviction kernel, defined on the first call (importing this module does not import triton);
    ImportError naming the fix without triton."""

    @triton.jit
    def _evict_insert(keys, values, pos, prio, seen, k_new, v_new, p_leave, p_new, H, B,
                      D: tl.constexpr, DV: tl.constexpr, S: tl.constexpr, W: tl.constexpr, K: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_K: tl.constexpr):
        row = tl.program_id(0)  # row = batch * H + head
        t = tl.load(seen + row // H)
        slot = tl.where(t < S, t, S + (t - S) % W)
        base = row.to(tl.int64) * B
        leaving_pos = tl.load(pos + base + slot)
        od = tl.arange(0, BLOCK_D)
        odv = tl.arange(0, BLOCK_DV)
        md = od < D
        mdv = odv < DV
        if K > 0:
            k_leave = tl.load(keys + (base + slot) * D + od, mask=md)
            v_leave = tl.load(values + (base + slot) * DV + odv, mask=mdv)
            ok = tl.arange(0, BLOCK_K)
            mk = ok < K
            big = 9223372036854775807
            pr = tl.load(prio + base + S + W + ok, mask=mk, other=float("inf"))
            ps = tl.load(pos + base + S + W + ok, mask=mk, other=big)
            weakest_p = tl.min(pr, axis=0)
            older = tl.where((pr == weakest_p) & mk, ps, big)
            oldest = tl.min(older, axis=0)
            idx = tl.min(tl.where((older == oldest) & mk, ok, BLOCK_K), axis=0)
            dest = S + W + idx
            pl = tl.load(p_leave + row)
            if (t - W >= S) & (leaving_pos >= S) & (pl >= weakest_p):
                tl.store(keys + (base + dest) * D + od, k_leave, mask=md)
                tl.store(values + (base + dest) * DV + odv, v_leave, mask=mdv)
                tl.store(pos + base + dest, leaving_pos)
                tl.store(prio + base + dest, pl)
        kn = tl.load(k_new + row.to(tl.int64) * D + od, mask=md)
        vn = tl.load(v_new + row.to(tl.int64) * DV + odv, mask=mdv)
        tl.store(keys + (base + slot) * D + od, kn.to(keys.dtype.element_ty), mask=md)
        tl.store(values + (base + slot) * DV + odv, vn.to(values.dtype.element_ty), mask=mdv)
        tl.store(pos + base + slot, t)
        tl.store(prio + base + slot, tl.load(p_new + row))

    return _evict_insert


def evict_and_insert_triton(keys, values, pos, prio, seen, k_new, v_new, p_leave, p_new,
                            sinks: int, window: int, topk: int) -> None:
    b, h, B, d = keys.shape
    dv = values.shape[-1]
    for name, x in (("keys", keys), ("values", values), ("pos", pos), ("prio", prio)):
        if not x.is_contiguous():
            raise ValueError(f"evict_and_insert_triton needs a contiguous `{name}` buffer")
    k_new = k_new.reshape(b, h, d).contiguous()
    v_new = v_new.reshape(b, h, dv).contiguous()
    p_leave = p_leave.reshape(b, h).float().contiguous()
    p_new = p_new.reshape(b, h).float().contiguous()
    evict_insert_kernel()[(b * h,)](keys, values, pos, prio, seen, k_new, v_new, p_leave, p_new, h, B,
                                    D=d, DV=dv, S=sinks, W=window, K=topk, BLOCK_D=next_pow2(d),
                                    BLOCK_DV=next_pow2(dv), BLOCK_K=next_pow2(topk))


def eviction_for(choice: str):
    """The eviction function a resolved ``Backends.decode_eviction`` names (kvpop_hf/backends.py): ``"triton"``
    (the fused kernel, the CUDA default) or ``"torch"`` (the reference). Chosen once, when a layer allocates its
    buffers, so decode steps neither read the environment nor branch on it; the kernel is defined now, outside any
    compiled decode step."""
    if choice == "triton":
        evict_insert_kernel()
    return {"triton": evict_and_insert_triton, "torch": evict_and_insert_reference}[choice]
