"""The mLSTM scorer's chunkwise forms (all sub-chunks at once, and one after another) equal its recurrent
step form."""

import torch

from kvpop_hf.scorers import MLSTMScorer
import pytest

from kvpop_hf.scorers.mlstm_ops import mlstm_chunkwise, mlstm_chunkwise_sequential, mlstm_step

pytestmark = pytest.mark.tier("unit")


@pytest.mark.parametrize("form", [mlstm_chunkwise, mlstm_chunkwise_sequential])
def test_chunkwise_equals_steps(form):
    g = torch.Generator().manual_seed(0)
    b, h, L, dk, dv = 2, 3, 37, 8, 5
    k, q = torch.randn(b, h, L, dk, generator=g), torch.randn(b, h, L, dk, generator=g)
    v = torch.randn(b, h, L, dv, generator=g)
    log_f = torch.nn.functional.logsigmoid(torch.randn(b, h, L, generator=g) + 2)
    i_gate = torch.rand(b, h, L, generator=g)
    C0, n0 = torch.randn(b, h, dk, dv, generator=g), torch.randn(b, h, dk, generator=g)
    C, n, hs = C0, n0, []
    for j in range(L):
        C, n, out = mlstm_step(C, n, k[:, :, j], v[:, :, j], log_f[:, :, j], i_gate[:, :, j], q[:, :, j])
        hs.append(out)
    for cs in (1, 5, 16, 37, 64):
        C2, n2, h2 = form(C0, n0, k, v, log_f, i_gate, q, chunk_size=cs)
        torch.testing.assert_close(h2, torch.stack(hs, 2), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(C2, C, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(n2, n, atol=1e-5, rtol=1e-5)


def test_scorer_padding_is_skipped():
    sc = MLSTMScorer(2, 2, 16, state_dim=8)
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(1, 2, 10, 16, generator=g), torch.randn(1, 2, 10, 16, generator=g)
    valid = torch.ones(1, 10, dtype=torch.bool)
    valid[0, :4] = False
    s_pad, r_pad = sc.absorb_and_read(0, sc.init_state(0, 1, "cpu"), k, v, valid, k, v)
    s_ref, r_ref = sc.absorb_and_read(0, sc.init_state(0, 1, "cpu"), k[:, :, 4:], v[:, :, 4:],
                                      valid[:, 4:], k[:, :, 4:], v[:, :, 4:])
    torch.testing.assert_close(r_pad[:, :, 4:], r_ref)
    torch.testing.assert_close(s_pad[0], s_ref[0])


def test_batched_chunkwise_gradients_equal_the_sequential_form():
    """Training runs the chunkwise form under autograd: the gradients match the sequential reference."""
    g = torch.Generator().manual_seed(3)
    b, h, L, dk, dv = 1, 2, 45, 4, 3
    inputs = [torch.randn(b, h, dk, dv, generator=g), torch.randn(b, h, dk, generator=g),
              torch.randn(b, h, L, dk, generator=g), torch.randn(b, h, L, dv, generator=g),
              torch.nn.functional.logsigmoid(torch.randn(b, h, L, generator=g) + 2),
              torch.rand(b, h, L, generator=g), torch.randn(b, h, L, dk, generator=g)]
    grads = []
    for form in (mlstm_chunkwise, mlstm_chunkwise_sequential):
        xs = [x.clone().requires_grad_(True) for x in inputs]
        C, n, out = form(*xs, chunk_size=8)
        (out.square().sum() + C.sum() + n.sum()).backward()
        grads.append([x.grad for x in xs])
    for a, e in zip(*grads):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-4)


def test_empty_input_keeps_the_memory():
    C0, n0 = torch.randn(1, 2, 4, 3), torch.randn(1, 2, 4)
    e = torch.zeros(1, 2, 0, 4)
    C, n, out = mlstm_chunkwise(C0, n0, e, torch.zeros(1, 2, 0, 3), torch.zeros(1, 2, 0), torch.zeros(1, 2, 0), e)
    assert out.shape == (1, 2, 0, 3) and torch.equal(C, C0) and torch.equal(n, n0)


def test_forget_bias_sets_the_initial_gate_and_survives_a_save(tmp_path):
    from helpers import tiny_config

    from kvpop_hf import KVpopCache

    cache = KVpopCache(tiny_config(), sinks=1, window=4, topk=3, scorer="mlstm", scorer_kwargs={"forget_bias": 4.5})
    assert torch.all(cache.scorer.bf == 4.5) and cache.scorer.config_dict()["forget_bias"] == 4.5
    assert torch.all(KVpopCache(tiny_config(), scorer="mlstm").scorer.bf == 3.0)  # the default
    cache.save_pretrained(tmp_path)
    loaded = KVpopCache.from_pretrained(tmp_path, tiny_config())
    assert loaded.scorer.forget_bias == 4.5 and torch.equal(loaded.scorer.bf, cache.scorer.bf)


def test_token_readout_adds_the_read_tokens_term_and_survives_a_save(tmp_path):
    """token_readout=True: r = (the plain readout) + at . SiLU(x_u Wt + bt) of the read token, with x_u = [k; v];
    with at = 0 it scores as the plain scorer of the same seed; it is saved and restored."""
    from helpers import tiny_config

    from kvpop_hf import KVpopCache
    from kvpop_hf.scorers.mlstm import MLSTMScorer

    b, h, d, n, ds = 2, 2, 8, 9, 4
    g = torch.Generator().manual_seed(0)
    plain, tok = MLSTMScorer(1, h, d, state_dim=ds, token_readout=False), MLSTMScorer(1, h, d, state_dim=ds)
    keys, values = torch.randn(b, h, n, d, generator=g), torch.randn(b, h, n, d, generator=g)
    rk, rv = torch.randn(b, h, n, d, generator=g), torch.randn(b, h, n, d, generator=g)
    valid = torch.ones(b, n, dtype=torch.bool)
    with torch.no_grad():
        _, r_plain = plain.absorb_and_read(0, plain.init_state(0, b, "cpu"), keys, values, valid, rk, rv)
        _, r_tok = tok.absorb_and_read(0, tok.init_state(0, b, "cpu"), keys, values, valid, rk, rv)
        x = torch.cat([rk, rv], -1)
        term = (torch.nn.functional.silu(torch.einsum("bhni,hio->bhno", x, tok.wt[0]) + tok.bt[0][None, :, None])
                * tok.at[0][None, :, None]).sum(-1)
        torch.testing.assert_close(r_tok, r_plain + term)
        tok.at.zero_()
        _, r_zero = tok.absorb_and_read(0, tok.init_state(0, b, "cpu"), keys, values, valid, rk, rv)
    torch.testing.assert_close(r_zero, r_plain)
    assert not hasattr(plain, "wt")  # the default scorer has no token weights (older checkpoints load unchanged)
    cache = KVpopCache(tiny_config(), sinks=1, window=4, topk=3, scorer="mlstm", scorer_kwargs={"token_readout": True})
    cache.save_pretrained(tmp_path)
    loaded = KVpopCache.from_pretrained(tmp_path, tiny_config())
    assert loaded.scorer.token_readout and torch.equal(loaded.scorer.wt, cache.scorer.wt)
