"""Bad input gets a clear error before any work."""

import pytest
import torch

from helpers import tiny_config, tiny_model
from kvpop_hf import KVpopCache, KVpopConfig


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
    cfg = tiny_config(layer_types=["full_attention", "sliding_attention"], sliding_window=8)
    with pytest.raises(ValueError, match="sliding_attention"):
        KVpopCache(cfg)
    cfg = tiny_config("mistral")
    cfg.sliding_window = 16
    with pytest.raises(ValueError, match="sliding"):
        KVpopCache(cfg)


def test_softcapped_attention_is_rejected():
    cfg = tiny_config()
    cfg.attn_logit_softcapping = 50.0
    with pytest.raises(ValueError, match="softcapping"):
        KVpopCache(cfg)


def test_config_roundtrip_rejects_unknown_keys():
    cfg = KVpopConfig(sinks=1, window=2, topk=3)
    assert KVpopConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="Unknown KVpop config keys"):
        KVpopConfig.from_dict({**cfg.to_dict(), "budget_tokens": 5})


def test_batch_change_needs_reset():
    model = tiny_model("qwen3")
    cache = KVpopCache(model.config, sinks=1, window=2, topk=3)
    model(torch.ones(2, 4, dtype=torch.long), past_key_values=cache)
    with pytest.raises(ValueError, match="reset"):
        model(torch.ones(3, 1, dtype=torch.long), past_key_values=cache)


def test_crop_is_refused():
    model = tiny_model("qwen3")
    cache = KVpopCache(model.config, sinks=1, window=2, topk=3)
    model(torch.ones(1, 4, dtype=torch.long), past_key_values=cache)
    with pytest.raises(NotImplementedError, match="cannot be cropped"):
        cache.crop(-1)
