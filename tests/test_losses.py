import math

import pytest
import torch
import torch.nn.functional as F

from kvpop_hf.trainer.losses import (
    balance_weights,
    boundary_loss,
    distillation_loss,
    margin_weights,
)

pytestmark = pytest.mark.tier("unit")


def _case(B=2, H=3, S=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    prio = torch.randn(B, H, S, generator=g).requires_grad_(True)
    t_new = torch.randint(0, S, (B, H, S), generator=g)
    t_bnd = torch.randint(0, S, (B, H, S), generator=g)
    t_bnd[torch.rand(B, H, S, generator=g) < 0.3] = -1
    keep = torch.rand(B, H, S, generator=g) < 0.5
    return prio, t_new, t_bnd, keep


def _loop_loss(prio, t_new, t_bnd, keep, temperature=1.0, omega=None, valid=None):
    B, H, Q = t_new.shape
    prio = prio.detach()
    tot, n = 0.0, 0
    for b in range(B):
        for h in range(H):
            for q in range(Q):
                if t_bnd[b, h, q] < 0 or (valid is not None and not valid[b, h, q]):
                    continue
                y = 1.0 if keep[b, h, q] else -1.0
                d = float(prio[b, h, t_new[b, h, q]] - prio[b, h, t_bnd[b, h, q]])
                w = 1.0 if omega is None else float(omega[b, h, q])
                tot += w * math.log1p(math.exp(-y * d / temperature))
                n += 1
    return tot / n


@pytest.mark.parametrize("temperature", [1.0, 0.5, 3.0])
def test_boundary_loss_matches_loop(temperature):
    prio, t_new, t_bnd, keep = _case(seed=1)
    got = boundary_loss(prio, t_new, t_bnd, keep, temperature=temperature)
    assert got.dim() == 0
    assert abs(got.item() - _loop_loss(prio, t_new, t_bnd, keep, temperature)) < 1e-5


def test_boundary_loss_valid_and_omega():
    prio, t_new, t_bnd, keep = _case(seed=2)
    g = torch.Generator().manual_seed(9)
    valid = torch.rand(t_new.shape, generator=g) < 0.7
    omega = torch.rand(t_new.shape, generator=g) * 2
    got = boundary_loss(prio, t_new, t_bnd, keep, temperature=0.7, omega=omega, valid=valid)
    want = _loop_loss(prio, t_new, t_bnd, keep, 0.7, omega, valid)
    assert abs(got.item() - want) < 1e-5


def test_boundary_loss_gradient():
    prio, t_new, t_bnd, keep = _case(seed=3)
    loss = boundary_loss(prio, t_new, t_bnd, keep)
    loss.backward()
    assert prio.grad is not None and torch.isfinite(prio.grad).all()
    assert prio.grad.abs().sum() > 0
    # gradient check against autograd on a manual formula
    p2 = prio.detach().clone().requires_grad_(True)
    v = t_bnd >= 0
    d = p2.gather(-1, t_new) - p2.gather(-1, t_bnd.clamp(min=0))
    y = keep.float() * 2 - 1
    manual = F.softplus(-y * d)[v].mean()
    manual.backward()
    torch.testing.assert_close(prio.grad, p2.grad)


def test_boundary_loss_direction():
    # keep_new => loss decreases as p_new grows
    prio = torch.zeros(1, 1, 4, requires_grad=True)
    t_new = torch.tensor([[[3, 0, 0, 0]]])
    t_bnd = torch.tensor([[[1, -1, -1, -1]]])
    keep = torch.tensor([[[True, False, False, False]]])
    boundary_loss(prio, t_new, t_bnd, keep).backward()
    assert prio.grad[0, 0, 3] < 0 and prio.grad[0, 0, 1] > 0
    assert abs(boundary_loss(prio, t_new, t_bnd, keep).item() - math.log(2)) < 1e-6


def test_boundary_loss_no_valid_term():
    prio, t_new, t_bnd, keep = _case(seed=4)
    t_bnd = torch.full_like(t_bnd, -1)
    loss = boundary_loss(prio, t_new, t_bnd, keep)
    assert loss.item() == 0.0
    assert loss.requires_grad
    loss.backward()
    assert prio.grad is not None and (prio.grad == 0).all()
    # valid mask all False as well
    prio2, t_new2, t_bnd2, keep2 = _case(seed=5)
    loss2 = boundary_loss(prio2, t_new2, t_bnd2, keep2, valid=torch.zeros_like(keep2))
    assert loss2.item() == 0.0 and loss2.requires_grad


def test_boundary_loss_nan_safe_on_invalid_slots():
    prio = torch.tensor([[[0.0, 1.0, -math.inf]]], requires_grad=True)
    t_new = torch.tensor([[[1, 2, 2]]])
    t_bnd = torch.tensor([[[0, -1, -1]]])
    keep = torch.tensor([[[True, True, False]]])
    loss = boundary_loss(prio, t_new, t_bnd, keep)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(prio.grad).all()


def test_boundary_loss_bad_inputs():
    prio, t_new, t_bnd, keep = _case(seed=6)
    with pytest.raises(ValueError):
        boundary_loss(prio, t_new, t_bnd, keep, temperature=0.0)
    with pytest.raises(ValueError):
        boundary_loss(prio, t_new[:, :2], t_bnd, keep)
    with pytest.raises(ValueError):
        boundary_loss(prio, t_new.float(), t_bnd, keep)
    with pytest.raises(ValueError):
        boundary_loss(prio, t_new, t_bnd, keep[..., :-1])
    with pytest.raises(ValueError):
        boundary_loss(prio, t_new, t_bnd, keep, omega=torch.ones(3))


def test_balance_weights():
    keep = torch.tensor([[[True, True, True, False, False, True]]])
    valid = torch.tensor([[[True, True, True, True, False, False]]])
    w = balance_weights(keep, valid)
    # valid: 3 keep, 1 drop, n=4 -> keep 4/6, drop 2
    torch.testing.assert_close(w, torch.tensor([[[4 / 6, 4 / 6, 4 / 6, 2.0, 0.0, 0.0]]]))
    assert abs((w * keep)[valid].sum().item() - (w * ~keep)[valid].sum().item()) < 1e-6
    assert abs(w[valid].mean().item() - 1.0) < 1e-6
    # one class only -> ones on valid
    w1 = balance_weights(torch.ones(1, 1, 3, dtype=torch.bool))
    torch.testing.assert_close(w1, torch.ones(1, 1, 3))
    # nothing valid -> zeros
    w0 = balance_weights(keep, torch.zeros_like(valid))
    assert (w0 == 0).all()


def test_margin_weights():
    r = torch.tensor([[[0.0, 0.0, 2.0, -5.0]]])
    t_new = torch.tensor([[[1, 2, 3, 0]]])
    t_bnd = torch.tensor([[[0, 0, 0, -1]]])
    # margins: 0, 2, 5, (invalid)
    wc = margin_weights(r, t_new, t_bnd, scale=1.0, mode="confident")
    base = torch.tensor([0.0, 1 - math.exp(-2), 1 - math.exp(-5)])
    torch.testing.assert_close(wc[0, 0, :3], base * 3 / base.sum())
    assert wc[0, 0, 3] == 0
    wa = margin_weights(r, t_new, t_bnd, scale=2.0, mode="ambiguous")
    base = torch.tensor([1.0, math.exp(-1), math.exp(-2.5)])
    torch.testing.assert_close(wa[0, 0, :3], base * 3 / base.sum())
    assert wa[0, 0, 3] == 0
    # ordering: ambiguous emphasises the near-tie, confident the clear decision
    assert wa[0, 0, 0] > wa[0, 0, 2] and wc[0, 0, 0] < wc[0, 0, 2]
    # floor keeps ties at a positive weight
    wf = margin_weights(r, t_new, t_bnd, floor=0.2)
    assert wf[0, 0, 0] > 0
    with pytest.raises(ValueError):
        margin_weights(r, t_new, t_bnd, mode="bogus")


def test_boundary_loss_with_helper_weights():
    prio, t_new, t_bnd, keep = _case(seed=8)
    g = torch.Generator().manual_seed(1)
    r = torch.randn(prio.shape, generator=g)
    valid = t_bnd >= 0
    omega = margin_weights(r, t_new, t_bnd) * balance_weights(keep, valid)
    got = boundary_loss(prio, t_new, t_bnd, keep, omega=omega)
    assert abs(got.item() - _loop_loss(prio, t_new, t_bnd, keep, omega=omega)) < 1e-5
    got.backward()
    assert torch.isfinite(prio.grad).all()


def _manual_kl(s, t, T):
    ps = torch.softmax(s.double() / T, -1)
    pt = torch.softmax(t.double() / T, -1)
    return (pt * (pt.log() - ps.log())).sum(-1) * T * T


@pytest.mark.parametrize("T", [1.0, 2.0, 0.5])
def test_distillation_matches_manual(T):
    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, 5, 11, generator=g, requires_grad=True)
    t = torch.randn(2, 5, 11, generator=g)
    got = distillation_loss(s, t, temperature=T)
    assert abs(got.item() - _manual_kl(s.detach(), t, T).mean().item()) < 1e-5
    got.backward()
    assert s.grad is not None and torch.isfinite(s.grad).all()


def test_distillation_identical_is_zero():
    s = torch.randn(2, 4, 9)
    assert abs(distillation_loss(s, s.clone(), temperature=2.0).item()) < 1e-6
    assert abs(distillation_loss(s.bfloat16(), s.bfloat16()).item()) < 1e-6


def test_distillation_mask():
    g = torch.Generator().manual_seed(3)
    s = torch.randn(2, 6, 7, generator=g, requires_grad=True)
    t = torch.randn(2, 6, 7, generator=g)
    mask = torch.rand(2, 6, generator=g) < 0.5
    mask[0, 0] = True
    got = distillation_loss(s, t, temperature=1.5, mask=mask)
    want = _manual_kl(s.detach(), t, 1.5)[mask].mean()
    assert abs(got.item() - want.item()) < 1e-5
    # garbage in masked positions does not matter
    s2 = s.detach().clone()
    s2[~mask] = 1e4
    assert abs(distillation_loss(s2, t, 1.5, mask).item() - got.item()) < 1e-5
    # empty mask -> 0 with grad
    z = distillation_loss(s, t, mask=torch.zeros_like(mask))
    assert z.item() == 0.0 and z.requires_grad
    with pytest.raises(ValueError):
        distillation_loss(s, t, mask=mask[:, :-1])
    with pytest.raises(ValueError):
        distillation_loss(s, t[..., :-1])
    with pytest.raises(ValueError):
        distillation_loss(s, t, temperature=0.0)


def test_distillation_teacher_neg_inf_logits():
    s = torch.randn(1, 3, 5, requires_grad=True)
    t = torch.randn(1, 3, 5)
    t[..., 0] = -math.inf
    loss = distillation_loss(s, t)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(s.grad).all()
