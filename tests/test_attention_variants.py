"""Attention variants (softcap, learned sinks, sliding windows, scaling) in the ``kvpop`` attention: the torch
reference against the models' own eager attention functions, and every KVpopCache path (chunk: dense and flex
backends; decode: torch and Triton backends) against the model's default cache, the fast paths routed to the
reference where they cannot compute the variant."""

import types

import pytest
import torch
from transformers import DynamicCache

from hybrid_helpers import VOCAB, hybrid_model
from kvpop_hf import KVpopCache
from kvpop_hf.attention import kvpop_attention
from kvpop_hf.attention_variants import AttentionVariant, causal_visible, variant_attention
from kvpop_hf.compat import with_cache
from kvpop_hf.ops.decode_attention import decode_attention_reference, decode_attention_triton
from kvpop_hf.handoff import DecodeSlots

pytestmark = pytest.mark.tier("unit")

B, HQ, HKV, L, D = 2, 4, 2, 7, 16


def _qkv(seed=0, C=L):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, HQ, L, D, generator=g) * 2, torch.randn(B, HKV, C, D, generator=g) * 2,
            torch.randn(B, HKV, C, D, generator=g))


def _additive(mask: torch.Tensor) -> torch.Tensor:
    return torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)


def _module(**attrs):
    return types.SimpleNamespace(num_key_value_groups=HQ // HKV, training=False, layer_idx=0, head_dim=D, **attrs)


@pytest.mark.parametrize("window", [None, 3])
def test_softcap_matches_gemma2_eager(window):
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    q, k, v = _qkv()
    mask = causal_visible(L, L, window, "cpu")
    expect, _ = eager_attention_forward(_module(), q, k, v, _additive(mask), dropout=0.0, scaling=0.2, softcap=1.5)
    got = variant_attention(q, k, v, mask, 0.2, AttentionVariant(softcap=1.5))
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-5)
    # the attention function, on keys from no KVpop layer (training, another cache): the sliding window comes
    # from the model's keyword when no mask is given
    got = kvpop_attention(_module(), q, k, v, None, scaling=0.2, softcap=1.5, sliding_window=window)[0]
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-5)
    plain = variant_attention(q, k, v, mask, 0.2)
    assert not torch.allclose(plain, expect, atol=1e-3)


@pytest.mark.parametrize("window", [None, 3])
def test_sinks_match_gpt_oss_eager(window):
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    q, k, v = _qkv(1)
    sinks = torch.randn(HQ) * 2
    mask = causal_visible(L, L, window, "cpu")
    expect, _ = eager_attention_forward(_module(sinks=sinks), q, k, v, _additive(mask), scaling=0.25)
    got = variant_attention(q, k, v, mask, 0.25, AttentionVariant(sinks=sinks))
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-5)
    got = kvpop_attention(_module(), q, k, v, mask, scaling=0.25, s_aux=sinks)[0]
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-5)
    # a module that holds its sinks as a parameter, without the keyword
    got = kvpop_attention(_module(sinks=torch.nn.Parameter(sinks)), q, k, v, mask, scaling=0.25)[0]
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-5)


def test_plain_variant_equals_sdpa_and_lse_includes_the_sink():
    q, k, v = _qkv(2)
    mask = causal_visible(L, L, None, "cpu")
    torch.testing.assert_close(variant_attention(q, k, v, mask, 0.3),
                               torch.nn.functional.scaled_dot_product_attention(
                                   q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask,
                                   scale=0.3).transpose(1, 2), atol=1e-5, rtol=1e-5)
    sinks = torch.randn(HQ)
    _, lse = variant_attention(q, k, v, mask, 0.3, AttentionVariant(sinks=sinks), return_lse=True)
    _, lse0 = variant_attention(q, k, v, mask, 0.3, return_lse=True)
    torch.testing.assert_close(lse, torch.logaddexp(lse0, sinks.view(1, -1, 1)))


@pytest.mark.parametrize("attention", [decode_attention_reference, decode_attention_triton])
def test_decode_slots_route_a_variant_to_the_reference(attention):
    """The Triton decode kernel computes a plain softmax: a step with a softcap or sinks takes the torch path."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, HQ, 1, D, generator=g)
    k, v = torch.randn(B, HKV, 12, D, generator=g), torch.randn(B, HKV, 12, D, generator=g)
    seen = torch.tensor([12, 5])
    mask = (torch.arange(12) < seen[:, None]).view(B, 1, 1, 12)
    slots = DecodeSlots(seen, attention)
    for variant in (AttentionVariant(softcap=1.0), AttentionVariant(sinks=torch.randn(HQ))):
        expect = variant_attention(q, k, v, mask, 0.3, variant)
        torch.testing.assert_close(slots.attend(q, k, v, 0.3, variant), expect, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(slots.attend(q, k, v, 0.3, AttentionVariant()), variant_attention(q, k, v, mask, 0.3),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name,sliding", [("gemma2", "window"), ("gpt_oss", "kvpop"), ("gemma3", "kvpop")])
def test_fast_backends_route_variants_and_windows(name, sliding):
    """Flex chunks and Triton decode steps as the cache's backends: softcap/sinks and sliding KVpop layers take the
    torch paths, and generation still equals the model's default cache (budget covering the sequence)."""
    model = hybrid_model(name)
    ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
    model.set_attn_implementation("eager")
    gen = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        ref = model.generate(ids, **with_cache(model, DynamicCache(config=model.config)), **gen)
    model.set_attn_implementation("kvpop")
    cache = KVpopCache(model.config, sinks=2, window=4, topk=58, sliding_layers=sliding,
                       backends={"chunk_attention": "flex", "decode_attention": "triton"})
    with torch.no_grad():
        out = model.generate(ids, **with_cache(model, cache), **gen)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)


def test_attention_based_policies_refuse_a_variant():
    model = hybrid_model("gemma2")
    cache = KVpopCache(model.config, sinks=2, window=4, topk=8, scorer="tova")
    with torch.no_grad(), pytest.raises(ValueError, match="softcap"):
        model(torch.randint(3, VOCAB, (1, 12)), **with_cache(model, cache))
