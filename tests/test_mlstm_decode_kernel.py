"""The fused mLSTM decode step (Triton, interpreted on CPU) == its torch reference (the path of
``KVpopLayer.decode_step`` without the kernel): read the token in the new token's ring slot (or the new token),
absorb the new token, score, decay; and a whole cache decoding with it == the reference mask."""

import pytest
import torch

from kvpop_hf.scorers.mlstm import MLSTMScorer
from kvpop_hf.scorers.mlstm_decode_triton import mlstm_decode_priority_reference, mlstm_decode_priority_triton

pytestmark = pytest.mark.tier("unit")


@pytest.mark.parametrize("ds", [8, 6])
@pytest.mark.parametrize("read_new", [False, True])
@pytest.mark.parametrize("decay", [False, True])
@pytest.mark.parametrize("token", [False, True])
def test_fused_mlstm_step_matches_torch(ds, read_new, decay, token):
    b, h, d, s, w, k, layers = 3, 2, 16, 2, 5, 7, 2
    B = s + w + k
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        scorer = MLSTMScorer(layers, h, d, state_dim=ds, delayed=not read_new, token_readout=token, seed=seed)
        with torch.no_grad():  # gate biases and readout biases away from their initial values
            for p in (scorer.bi, scorer.bf, scorer.b) + ((scorer.bt,) if token else ()):
                p.add_(torch.randn(p.shape, generator=g))
        keys, values = torch.randn(b, h, B, d, generator=g), torch.randn(b, h, B, d, generator=g)
        seen = torch.randint(0, 4 * B, (b,), generator=g)
        pos = torch.randint(-1, 4 * B, (b, h, B), generator=g)
        k_new, v_new = torch.randn(b, h, 1, d, generator=g), torch.randn(b, h, 1, d, generator=g)
        C = torch.randn(b, h, ds, ds, generator=g)
        n = torch.randn(b, h, ds, generator=g)
        log_gamma = -torch.rand(h, generator=g) if decay else None
        layer = seed % layers
        with torch.no_grad():
            C_ref, n_ref = C.clone(), n.clone()
            p_ref = mlstm_decode_priority_reference(scorer, layer, (C_ref, n_ref), keys, values, pos, seen, k_new,
                                                    v_new, s, w, log_gamma, 4, read_new)
            p = mlstm_decode_priority_triton(scorer, layer, (C, n), keys, values, pos, seen, k_new, v_new, s, w,
                                             log_gamma, 4, read_new)
        torch.testing.assert_close(p, p_ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(C, C_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(n, n_ref, atol=1e-5, rtol=1e-5)


def test_fused_mlstm_step_rejects_a_non_float32_state():
    scorer = MLSTMScorer(1, 2, 8, state_dim=4)
    keys = torch.zeros(1, 2, 6, 8)
    state = (torch.zeros(1, 2, 4, 4, dtype=torch.float64), torch.zeros(1, 2, 4))
    with pytest.raises(ValueError, match="float32"):
        mlstm_decode_priority_triton(scorer, 0, state, keys, keys, torch.zeros(1, 2, 6, dtype=torch.long),
                                     torch.zeros(1, dtype=torch.long), keys[:, :, :1], keys[:, :, :1], 1, 2, None, 4,
                                     False)


@pytest.mark.parametrize("delayed,token", [(True, False), (False, False), (True, True)])
def test_cache_decode_with_every_kernel_matches_reference_mask(monkeypatch, delayed, token):
    """Every token a decode step of a KVpopCache with the mLSTM scorer and recency decay, with the fused
    mLSTM step, the fused eviction and the split attention (all Triton, interpreted): logits equal the
    independent reference mask."""
    from helpers import distinct_ids, reference_logits, tiny_model

    from kvpop_hf import KVpopCache
    from kvpop_hf.compat import with_cache

    for var in ("KVPOP_MLSTM_STEP", "KVPOP_DECODE_EVICTION", "KVPOP_DECODE_ATTENTION"):
        monkeypatch.setenv(var, "triton")
    kw = dict(sinks=2, window=4, topk=6, log_gamma=-0.3, decay_step=5)
    model = tiny_model("qwen3")
    ids = distinct_ids(1, 30, seed=5)
    cache = KVpopCache(model.config, scorer="mlstm", scorer_kwargs={"delayed": delayed, "token_readout": token},
                       **kw)
    ref, _ = reference_logits(model, ids, cache.scorer, kw["sinks"], kw["window"], kw["topk"],
                              cache.log_gamma, kw["decay_step"])
    forward = lambda x: model(x, **with_cache(model, cache)).logits  # noqa: E731
    with torch.no_grad():
        out = torch.cat([forward(ids[:, i:i + 1]) for i in range(ids.shape[1])], 1)
    assert all(layer._scorer_step is not None for layer in cache.layers)
    torch.testing.assert_close(out, ref, atol=3e-5, rtol=0)


def test_fused_step_is_the_cuda_default(monkeypatch):
    """On by default on CUDA, off on CPU (Backends.mlstm_step); the layer asks the scorer for it only then."""
    from helpers import tiny_model

    from kvpop_hf import Backends, KVpopCache
    from kvpop_hf.compat import with_cache

    monkeypatch.delenv("KVPOP_MLSTM_STEP", raising=False)
    assert Backends().resolve(torch.device("cuda")).mlstm_step == "triton"
    assert Backends().resolve(torch.device("cpu")).mlstm_step == "torch"
    assert MLSTMScorer(1, 2, 8, state_dim=4).decode_kernel(torch.device("cpu")) is mlstm_decode_priority_triton
    model = tiny_model("qwen3")
    for choice, fused in (("auto", False), ("torch", False), ("triton", True)):
        cache = KVpopCache(model.config, sinks=2, window=4, topk=6, scorer="mlstm", backends={"mlstm_step": choice})
        model(torch.tensor([[1, 2]]), **with_cache(model, cache))
        assert all((layer._scorer_step is mlstm_decode_priority_triton) == fused for layer in cache.layers)
