"""A KVpopCache prompt chunk's attention: each query attends to its exact per-head set ``R(q)``.

The chunk's :class:`~kvpop_hf.layer.ChunkPlan` gives, per (row, KV head), the candidates (stored slots, then
the chunk's new tokens) and which of them each query sees. Two implementations:

* dense: the plan's ``[b, Hkv, L, C]`` visibility as an SDPA mask (the G query heads of a KV head share it);
* flex: FlexAttention with a block mask built from the plan's compact form (no ``[L x C]`` mask), compiled on
  CUDA (:mod:`kvpop_hf.ops.flex_compiled`).
"""

from __future__ import annotations

from torch.nn import functional as F

from ..backends import INFERENCE_FIELDS, Backends


def _flex_fns(device_type: str):
    """``(flex_attention, create_block_mask)``, compiled on CUDA with dynamic shapes
    (kvpop_hf/ops/flex_compiled.py)."""
    from .flex_compiled import INFERENCE_DYNAMIC, compiled_create_block_mask, compiled_flex

    return compiled_flex(device_type, INFERENCE_DYNAMIC), compiled_create_block_mask(device_type, INFERENCE_DYNAMIC)


def flex_chunk_attention(plan, query, key, value, scaling, backends: Backends | None = None):
    """FlexAttention over the chunk's candidates. ``backends`` (resolved; default: the device's) gives the block
    mask (``_flex_block_mask``): ``interval`` (the default) reorders the candidates so that each query block visits
    about ``B / 128`` key blocks (kvpop_hf/ops/interval_mask.py), the variants ``tiled`` (plan order with the
    rank/cutoff block flags) and ``create`` (``create_block_mask``) keep plan order; and the cutoff
    (``_chunk_cutoff``)."""
    backends = backends or Backends.defaults(query.device, INFERENCE_FIELDS)
    b, hq, L, _ = query.shape
    hkv, C = key.shape[1], key.shape[2]
    groups = hq // hkv
    flex, make_block_mask = _flex_fns(query.device.type)
    cm = plan.compact(backend=backends._chunk_cutoff)
    layout = backends._flex_block_mask
    if layout == "interval":
        from .interval_mask import interval_block_mask, interval_chunk_mask, interval_layout

        im = interval_layout(interval_chunk_mask(cm))
        key = key.gather(2, im.perm[..., None].expand(b, hkv, C, key.shape[-1]))
        value = value.gather(2, im.perm[..., None].expand(b, hkv, C, value.shape[-1]))
        block_mask = interval_block_mask(im, groups)
    elif layout == "create":
        block_mask = make_block_mask(cm.mask_mod(groups), b, hq, L, C, device=query.device)
    else:  # never holds the [b, Hq, L, C] grid (create_block_mask does, even compiled)
        from .flex_mask import build_block_mask

        block_mask = build_block_mask(cm, groups)
    key, value = key.to(query.dtype), value.to(query.dtype)
    kw = {"enable_gqa": True} if groups > 1 else {}
    out = flex(query, key, value, block_mask=block_mask, scale=scaling, **kw)
    return out.transpose(1, 2).contiguous()


def attend_chunk(plan, query, key, value, scaling, backends: Backends, variant=None):
    """query ``[b, Hq, L, d]``, key/value ``[b, Hkv, C, d]`` (the plan's candidates) -> ``[b, L, Hq, dv]``, by
    ``backends.chunk_attention`` (a resolved :class:`~kvpop_hf.backends.Backends`): ``flex`` or ``dense``.

    A softcap or sinks (``variant``) take the torch reference over the plan's mask
    (:func:`kvpop_hf.attention_variants.variant_attention`); a plan with a sliding window (a KVpop layer on a
    sliding layer) the dense path: FlexAttention's block masks here express neither."""
    if variant is not None and not variant.plain:
        from ..attention_variants import variant_attention

        return variant_attention(query, key, value, plan.visibility(), scaling, variant)
    if backends.chunk_attention == "flex" and getattr(plan, "attention_window", None) is None:
        return flex_chunk_attention(plan, query, key, value, scaling, backends)
    b, hq, L, d = query.shape
    hkv = key.shape[1]
    groups = hq // hkv
    vis = plan.visibility()  # [b, hkv, L, C]
    # group the G query heads of each KV head along the query axis: no copy of keys/values
    q = query.reshape(b, hkv, groups * L, d)
    mask = vis[:, :, None].expand(b, hkv, groups, L, vis.shape[-1]).reshape(b, hkv, groups * L, vis.shape[-1])
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, hq, L, value.shape[-1]).transpose(1, 2).contiguous()
