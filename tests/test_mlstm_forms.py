"""The mLSTM scorer's chunkwise form equals its recurrent step form."""

import torch

from kvpop_hf.scorers import MLSTMScorer
from kvpop_hf.scorers.mlstm_ops import mlstm_chunkwise, mlstm_step


def test_chunkwise_equals_steps():
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
    for cs in (1, 5, 16, 64):
        C2, n2, h2 = mlstm_chunkwise(C0, n0, k, v, log_f, i_gate, q, chunk_size=cs)
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
