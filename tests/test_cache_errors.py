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


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "qwen3_next"])
def test_reuse_with_another_batch_size_without_reset(name):
    """A cache filled at batch size 1 and reused at batch size 2 is a ValueError naming both sizes and reset(), raised
    at the forward's first cache update (before a sliding or linear-attention layer fails on its own); after
    ``reset()`` the cache serves the new batch."""
    from hybrid_helpers import hybrid_model

    model = tiny_model("qwen3") if name == "qwen3" else hybrid_model(name)
    cache = KVpopCache(model.config, sinks=1, window=2, topk=2)
    ids = torch.arange(3, 12)[None]
    model.generate(ids, **with_cache(model, cache, max_new_tokens=2, do_sample=False))
    seen = cache.get_seq_length()
    with pytest.raises(ValueError, match=r"holds batch size 1 from an earlier generation; call cache.reset\(\) "
                                         r"before using it with batch size 2"):
        model.generate(ids.repeat(2, 1), **with_cache(model, cache, max_new_tokens=2, do_sample=False))
    assert cache.get_seq_length() == seen  # no layer worked
    cache.reset()
    out = model.generate(ids.repeat(2, 1), **with_cache(model, cache, max_new_tokens=2, do_sample=False))
    assert out.shape == (2, 11)


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "qwen3_next"])
def test_reuse_under_another_dtype_without_reset(name):
    """A cache filled by a float32 model and reused under bfloat16 is a ValueError naming both dtypes, before any
    work; after ``reset()`` it serves the bfloat16 model (transformers' own sliding and linear-attention layers too)."""
    from hybrid_helpers import hybrid_model

    model = tiny_model("qwen3") if name == "qwen3" else hybrid_model(name)
    cache = KVpopCache(model.config, sinks=1, window=2, topk=2)
    ids = torch.arange(3, 12)[None]
    model.generate(ids, **with_cache(model, cache, max_new_tokens=2, do_sample=False))
    seen = cache.get_seq_length()
    model.to(torch.bfloat16)
    with pytest.raises(ValueError, match="holds float32 keys from an earlier generation, but the model gives "
                                         r"bfloat16: call cache.reset\(\)"):
        model.generate(ids, **with_cache(model, cache, max_new_tokens=2, do_sample=False))
    assert cache.get_seq_length() == seen
    cache.reset()
    model.generate(ids, **with_cache(model, cache, max_new_tokens=2, do_sample=False))
    assert all(layer.keys.dtype == torch.bfloat16 for layer in cache.kvpop_layers())


@pytest.mark.parametrize("kw", [dict(scorer="mlp"), dict(scorer="mlstm"), dict(scorer="kvp"),
                                dict(kvpop_config=KVpopConfig(sinks=1, window=2, topk=2, scorer="mlstm"))])
def test_learned_scorer_by_name_warns_its_weights_are_random(kw):
    """A learned scorer built from its name has random weights: an UntrainedScorerWarning at construction naming
    the scorer and the ways out (from_pretrained, a trained Scorer module, the training-free 'knorm')."""
    from kvpop_hf import UntrainedScorerWarning

    name = kw.get("scorer") or kw["kvpop_config"].scorer
    with pytest.warns(UntrainedScorerWarning, match=rf"learned scorer '{name}' from its name, so its weights are "
                                                    r"random \(untrained\).*KVpopCache\.from_pretrained\(checkpoint_"
                                                    r"dir, model\.config\).*scorer='knorm'") as record:
        KVpopCache(tiny_config(), **kw)
    assert issubclass(UntrainedScorerWarning, UserWarning)
    assert record[0].filename == __file__  # it points at the caller


def test_trained_or_training_free_scorers_do_not_warn(tmp_path):
    """No UntrainedScorerWarning for a training-free scorer, a Scorer module passed in (the trainer's way: it trains
    the module it builds) or a checkpoint loaded by from_pretrained (its weights are the trained ones)."""
    from kvpop_hf import UntrainedScorerWarning, build_scorer

    model = tiny_model("qwen3")
    with pytest.warns(UntrainedScorerWarning):
        KVpopCache(model.config, sinks=1, window=2, topk=2, scorer="mlp").save_pretrained(tmp_path)
    cfg = model.config
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        KVpopCache(cfg, scorer="knorm")
        KVpopCache(cfg, scorer="streaming")
        KVpopCache(cfg, scorer=build_scorer("mlstm", cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim))
        loaded = KVpopCache.from_pretrained(tmp_path, cfg)
        with_kv = with_cache(model, loaded, max_new_tokens=2, do_sample=False)
        model.generate(torch.arange(3, 12)[None], **with_kv)
    assert not [r for r in record if issubclass(r.category, UntrainedScorerWarning)]


@pytest.mark.parametrize("kw, match", [
    (dict(window=64), r"trained with window=2 \(its kvpop_config.json\), but from_pretrained got window=64: .*"
                      r"Omit window= to use the trained value\."),
    (dict(sinks=0, window=64, topk=5), r"trained with sinks=1, window=2 .* got sinks=0, window=64: .*"
                                       r"Omit sinks= and window= to use the trained values\."),
])
def test_from_pretrained_refuses_another_sinks_or_window_than_trained(tmp_path, kw, match):
    """A learned scorer serves at the sinks and window it was trained with: other values are a ValueError naming
    both and the fix; the trained values themselves and a topk override are accepted."""
    model = tiny_model("qwen3")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # random weights: the checkpoint's values are what is tested
        KVpopCache(model.config, sinks=1, window=2, topk=3, scorer="mlp").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=match):
        KVpopCache.from_pretrained(tmp_path, model.config, **kw)
    cache = KVpopCache.from_pretrained(tmp_path, model.config, sinks=1, window=2, topk=9)
    assert (cache.kvpop_config.sinks, cache.kvpop_config.window, cache.budget) == (1, 2, 12)


def test_from_pretrained_refuses_to_swap_the_scorer(tmp_path):
    """scorer= another than the checkpoint's: a ValueError saying a checkpoint's scorer cannot be swapped and how to
    build the other cache (not the corrupt-checkpoint message about editing kvpop_config.json)."""
    model = tiny_model("qwen3")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        KVpopCache(model.config, sinks=1, window=2, topk=3, scorer="mlp").save_pretrained(tmp_path)
    for other in ("knorm", "mlstm"):
        with pytest.raises(ValueError, match=rf"A checkpoint's scorer cannot be swapped: .* holds the scorer 'mlp' .*"
                                             rf"KVpopCache\(model.config, scorer='{other}', sinks=\.\.\., window=\.\.\., "
                                             r"topk=\.\.\.\); to serve the checkpoint, omit scorer=\.") as err:
            KVpopCache.from_pretrained(tmp_path, model.config, scorer=other)
        assert "kvpop_config.json" not in str(err.value)
    assert KVpopCache.from_pretrained(tmp_path, model.config, scorer="mlp").kvpop_config.scorer == "mlp"


def test_evaluation_policy_from_a_path_takes_the_requested_budget(tmp_path):
    """kvpop-eval's learned policies serve an untagged checkpoint at the requested budget (kvpop_hf/policies.py),
    from a path as from a loaded prototype: from_pretrained's refusal of other sinks/window does not reach them."""
    from kvpop_hf.policies import POLICIES, load_prototype

    model = tiny_model("qwen3")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        KVpopCache(model.config, sinks=1, window=2, topk=3, scorer="mlp").save_pretrained(tmp_path)
    factory = POLICIES["kvpop_mlp"].factory
    for checkpoint in (str(tmp_path), load_prototype("kvpop_mlp", str(tmp_path))):
        cache = factory(model.config, 2, 4, 6, checkpoint=checkpoint)
        assert (cache.kvpop_config.sinks, cache.kvpop_config.window, cache.kvpop_config.topk) == (2, 4, 6)
