"""Bad input gets a clear error before any work."""

import warnings

import pytest
import torch

from helpers import tiny_config, tiny_model
from kvpop_hf import KVpopCache, KVpopConfig
from kvpop_hf.compat import with_cache

pytestmark = pytest.mark.tier("unit")


@pytest.mark.parametrize("kw, match", [
    (dict(sinks=-1), "sinks"), (dict(window=0), "window"), (dict(topk=2.5), "topk"), (dict(topk=True), "topk"),
    (dict(sinks="4"), "sinks"), (dict(decay_step=0), "decay_step"), (dict(log_gamma=0.3), "log_gamma"),
])
def test_bad_budget(kw, match):
    with pytest.raises(ValueError, match=match):
        KVpopCache(tiny_config(), **kw)


def test_unknown_scorer_and_kwargs():
    with pytest.raises(ValueError, match="Available scorers"):
        KVpopCache(tiny_config(), scorer="h2o-typo")
    with pytest.raises(ValueError, match="scorer_kwargs"):
        KVpopCache(tiny_config(), scorer="mlp", scorer_kwargs={"hiden": 3})


def test_unsupported_attention_layers():
    """Hybrid layer patterns are served (tests/test_hybrid_generation.py); what cannot be is named."""
    cfg = tiny_config(layer_types=["full_attention", "sliding_attention"], sliding_window=8)
    if cfg.sliding_window is None:  # Qwen3 drops the window without use_sliding_window: no size for the sliding layer
        with pytest.raises(ValueError, match="no window size"):
            KVpopCache(cfg)
    cfg = tiny_config("mistral")
    cfg.sliding_window = 16
    with pytest.raises(ValueError, match="sliding_layers='kvpop'"):  # every layer slides: nothing for KVpop by default
        KVpopCache(cfg)
    assert KVpopCache(cfg, sliding_layers="kvpop").kvpop_layer_indices == [0, 1]
    cfg = tiny_config(layer_types=["full_attention", "hybrid"])
    with pytest.raises(ValueError, match="hybrid"):
        KVpopCache(cfg)


def test_methods_for_full_attention_refuse_hybrids():
    from kvpop_hf.baselines.dms import DMSCache

    cfg = tiny_config()
    cfg.attn_logit_softcapping = 50.0
    with pytest.raises(ValueError, match="caps attention logits"):
        DMSCache(cfg)
    cfg = tiny_config("mistral")
    cfg.sliding_window = 16
    with pytest.raises(ValueError, match="sliding_attention"):
        DMSCache(cfg)


def test_config_roundtrip_rejects_unknown_keys():
    cfg = KVpopConfig(sinks=1, window=2, topk=3)
    assert KVpopConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="Unknown KVpop config keys"):
        KVpopConfig.from_dict({**cfg.to_dict(), "budget_tokens": 5})


def test_batch_change_needs_reset():
    model = tiny_model("qwen3")
    cache = KVpopCache(model.config, sinks=1, window=2, topk=3)
    model(torch.ones(2, 4, dtype=torch.long), **with_cache(model, cache))
    with pytest.raises(ValueError, match="reset"):
        model(torch.ones(3, 1, dtype=torch.long), **with_cache(model, cache))


def test_crop_is_refused():
    model = tiny_model("qwen3")
    cache = KVpopCache(model.config, sinks=1, window=2, topk=3)
    model(torch.ones(1, 4, dtype=torch.long), **with_cache(model, cache))
    with pytest.raises(NotImplementedError, match="cannot be cropped"):
        cache.crop(-1)


def test_layer_count_mismatch_is_named():
    deep, shallow = tiny_model("qwen3", layers=3), tiny_model("qwen3", layers=2)
    ids = torch.arange(1, 9)[None]
    too_few = KVpopCache(shallow.config, sinks=1, window=2, topk=3)  # 2 layers, used on a 3-layer model
    with pytest.raises(ValueError, match="updates layer 2, but this KVpopCache has 2 layers"):
        deep(ids, **with_cache(deep, too_few))
    too_many = KVpopCache(deep.config, sinks=1, window=2, topk=3)  # 3 layers, used on a 2-layer model
    shallow(ids, **with_cache(shallow, too_many))  # nothing tells the cache the model's depth yet
    with pytest.raises(ValueError, match="updated 2 of this KVpopCache's 3 layers"):
        shallow(ids[:, :1], **with_cache(shallow, too_many))


def test_failed_forward_asks_for_reset():
    model = tiny_model("qwen3", layers=2)
    cache = KVpopCache(model.config, sinks=1, window=2, topk=3)

    def boom(module, args, kwargs):
        raise RuntimeError("boom")

    handle = model.model.layers[1].self_attn.register_forward_pre_hook(boom, with_kwargs=True)
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.arange(1, 6)[None], **with_cache(model, cache))
    handle.remove()
    with pytest.raises(ValueError, match="cache.reset"):
        model(torch.arange(1, 6)[None], **with_cache(model, cache))
    cache.reset()
    model(torch.arange(1, 6)[None], **with_cache(model, cache))


@pytest.mark.parametrize("scorer, kwargs, match", [
    ("mlp", {"hidden": -1}, "hidden"), ("mlp", {"hidden": 2.5}, "hidden"), ("mlstm", {"state_dim": 0}, "state_dim"),
    ("mlstm", {"chunk_size": -4}, "chunk_size"), ("mlstm", {"delayed": "yes"}, "delayed"),
    ("mlstm", {"forget_bias": "4"}, "forget_bias"), ("mlstm", {"forget_bias": float("inf")}, "forget_bias"),
    ("mlstm", {"token_readout": 1}, "token_readout"),
])
def test_bad_scorer_options(scorer, kwargs, match):
    with pytest.raises(ValueError, match=match):
        KVpopCache(tiny_config(), scorer=scorer, scorer_kwargs=kwargs)


def test_stock_attention_warning_points_at_the_caller():
    model = tiny_model("qwen3", attn="sdpa")
    cache = KVpopCache(model.config, sinks=1, window=2, topk=3)
    with pytest.warns(UserWarning, match="stock attention") as record:
        model(torch.arange(1, 9)[None], **with_cache(model, cache))
        model(torch.arange(1, 9)[None], **with_cache(model, cache))  # the unused chunk is noticed here
    ours = [r for r in record if "stock attention" in str(r.message)]
    assert [r.filename for r in ours] == [__file__]


def _passes_position_ids_to_update() -> bool:
    import inspect

    from transformers.models.qwen3 import modeling_qwen3

    return "kwargs=kwargs" in inspect.getsource(modeling_qwen3.Qwen3Attention.forward)


def _generate(model, ids, mask):
    cache = KVpopCache(model.config, sinks=1, window=2, topk=2)
    return model.generate(ids, attention_mask=mask, **with_cache(model, cache), max_new_tokens=4, do_sample=False,
                          pad_token_id=0)


def _left_padded_batch_under_sdpa():
    """A tiny Qwen3 with `sdpa` and a batch of two rows, the second left-padded by two tokens."""
    ids = torch.arange(1, 13).view(2, 6)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return tiny_model("qwen3", attn="sdpa"), ids, mask


def test_left_padding_with_stock_attention_is_refused():
    """sdpa never shows the padding mask to the cache; where transformers hands the position ids to
    `update` (5.24), the padded prefill is recognised and generation stops with the fix named."""
    if not _passes_position_ids_to_update():
        pytest.skip("this transformers version does not pass the attention kwargs to Cache.update")
    model, ids, mask = _left_padded_batch_under_sdpa()
    with pytest.raises(ValueError, match="attn_implementation='kvpop'"):
        _generate(model, ids, mask)
    # unpadded batches still run with stock attention (with the chunk warning)
    with pytest.warns(UserWarning, match="stock attention"):
        _generate(model, ids, torch.ones_like(ids))


def test_stock_attention_warning_says_when_padding_goes_unseen():
    """Where transformers passes nothing but keys and values to `update` (5.17), a batch of several rows under
    a stock attention gets a warning that left padding cannot be recognised; a single row does not."""
    if _passes_position_ids_to_update():
        pytest.skip("this transformers version passes the position ids: padding raises instead")
    model, ids, mask = _left_padded_batch_under_sdpa()
    with pytest.warns(UserWarning, match="left-padded batch cannot be recognised"):
        _generate(model, ids, mask)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _generate(model, ids[:1], mask[:1])
    assert any("stock attention" in str(r.message) for r in record)
    assert not any("left-padded" in str(r.message) for r in record)
