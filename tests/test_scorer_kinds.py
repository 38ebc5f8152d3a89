"""A scorer's kind (``stateful``, ``delayed``, ``dynamic``) is a declared class attribute of ``Scorer``: a
subclass that sets none of them is a stateless static scorer, and the cache and the trainer follow each one."""

import torch

from helpers import tiny_config
from kvpop_hf import KVpopCache
from kvpop_hf.baselines.attention_policies.layer import DynamicScoreLayer
from kvpop_hf.layer import KVpopLayer
from kvpop_hf.scorers import SCORERS, Scorer
from kvpop_hf.ops.priorities import sequence_priorities
import pytest

pytestmark = pytest.mark.tier("unit")

KINDS = {  # name: (stateful, delayed, dynamic)
    "streaming": (False, True, False), "knorm": (False, True, False), "random": (False, True, False),
    "mlp": (False, True, False), "kvp": (False, True, False), "keydiff": (True, True, False),
    "lagkv": (True, True, False), "mlstm": (True, True, False), "tova": (False, True, True),
    "h2o": (False, True, True), "snapkv": (False, True, True),
}


def test_every_registered_scorer_declares_its_kind():
    assert set(KINDS) == set(SCORERS)
    for name, cls in SCORERS.items():
        assert (cls.stateful, cls.delayed, cls.dynamic) == KINDS[name], name
    assert (Scorer.stateful, Scorer.delayed, Scorer.dynamic) == (False, True, False)
    assert all(Scorer.__dict__[a] is not None for a in ("stateful", "delayed", "dynamic"))


class _NormScorer(Scorer):
    """Sets no kind: stateless, static."""

    def score(self, layer_idx, keys, values, positions):
        return keys.float().norm(dim=-1)


class _LastKeyScorer(Scorer):
    """Stateful: scores a read token by its key's dot product with the last absorbed key."""

    stateful = True

    def init_state(self, layer_idx, batch_size, device):
        return (torch.zeros(batch_size, self.num_kv_heads, self.head_dim, device=device),)

    def absorb_and_read(self, layer_idx, state, new_keys, new_values, new_valid, read_keys, read_values):
        return (new_keys[:, :, -1].float(),), (read_keys.float() * new_keys.float()).sum(-1)


class _ImmediateLastKeyScorer(_LastKeyScorer):
    delayed = False


def test_a_scorer_without_kind_attributes_is_static_and_stateless():
    cfg = tiny_config()
    cache = KVpopCache(cfg, sinks=1, window=2, topk=3, scorer=_NormScorer(cfg.num_hidden_layers,
                                                                         cfg.num_key_value_heads, cfg.head_dim))
    assert all(type(layer) is KVpopLayer for layer in cache.layers)
    keys = torch.randn(1, cfg.num_key_value_heads, 6, cfg.head_dim)
    r = sequence_priorities(cache.scorer, 0, keys, keys, window=2)
    torch.testing.assert_close(r, keys.norm(dim=-1))


def test_dynamic_scorer_gets_the_dynamic_layer():
    cache = KVpopCache(tiny_config(), sinks=1, window=2, topk=3, scorer="tova")
    assert all(isinstance(layer, DynamicScoreLayer) for layer in cache.layers)


def test_delayed_decides_which_token_a_stateful_scorer_reads():
    h, d, S, w = 2, 4, 7, 2
    keys = torch.randn(1, h, S, d)
    delayed = sequence_priorities(_LastKeyScorer(1, h, d), 0, keys, keys, window=w)
    immediate = sequence_priorities(_ImmediateLastKeyScorer(1, h, d), 0, keys, keys, window=w)
    # immediate: token t read right after absorbing it; delayed: token u read after absorbing u + w
    torch.testing.assert_close(immediate, (keys * keys).sum(-1))
    torch.testing.assert_close(delayed[:, :, :S - w], (keys[:, :, :S - w] * keys[:, :, w:]).sum(-1))
    assert torch.isinf(delayed[:, :, S - w:]).all()
