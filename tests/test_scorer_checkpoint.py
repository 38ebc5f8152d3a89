"""checkpointed_priorities: same priorities and gradients as the scorer called directly, less held memory."""

import pytest
import torch

from kvpop_hf.scorers import build_scorer
from kvpop_hf.ops.priorities import sequence_priorities
from kvpop_hf.trainer.scorer_checkpoint import checkpointed_priorities

pytestmark = pytest.mark.tier("unit")


@pytest.mark.parametrize("name", ["mlp", "mlstm"])
def test_values_and_gradients_match_the_direct_call(name):
    torch.manual_seed(0)
    scorer = build_scorer(name, 2, 2, 8, **({"state_dim": 4} if name == "mlstm" else {}))
    log_gamma = torch.nn.Parameter(torch.full((2, 2), -0.2))
    keys, values = torch.randn(1, 2, 50, 8), torch.randn(1, 2, 50, 8)
    weights = torch.randn(1, 2, 50)

    def fn(k, v):
        return sequence_priorities(scorer, 1, k, v, 6, log_gamma[1], 4)

    params = list(scorer.parameters()) + [log_gamma]
    direct = fn(keys, values)
    finite = torch.isfinite(direct)
    g_direct = torch.autograd.grad((direct[finite] * weights[finite]).sum(), params, allow_unused=True)
    ckpt = checkpointed_priorities(fn, keys, values, params)
    assert ckpt.grad_fn is not None
    torch.testing.assert_close(ckpt, direct, atol=0, rtol=0)
    g_ckpt = torch.autograd.grad((ckpt[finite] * weights[finite]).sum(), params, allow_unused=True)
    assert any(g is not None and g.abs().sum() > 0 for g in g_direct)
    for a, b in zip(g_ckpt, g_direct):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_holds_only_its_inputs():
    scorer = build_scorer("mlstm", 1, 2, 8, state_dim=4)
    keys, values = torch.randn(1, 2, 64, 8), torch.randn(1, 2, 64, 8)
    packed = []

    def pack(t):
        packed.append(t)
        return t

    def fn(k, v):
        return sequence_priorities(scorer, 0, k, v, 4)

    for run in (fn, lambda k, v: checkpointed_priorities(fn, k, v, scorer.parameters())):
        packed.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run(keys, values)
        held = {id(t) for t in packed if not isinstance(t, torch.nn.Parameter)}
        if run is fn:
            assert len(held) > 4  # the scorer's activations
        else:
            assert held == {id(keys), id(values)}


def test_no_gradient_needed_is_a_plain_call_and_attached_inputs_are_refused():
    scorer = build_scorer("mlp", 1, 2, 8).requires_grad_(False)
    keys, values = torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)

    def fn(k, v):
        return sequence_priorities(scorer, 0, k, v, 4)

    assert checkpointed_priorities(fn, keys, values, scorer.parameters()).grad_fn is None
    with pytest.raises(ValueError, match="detached"):
        checkpointed_priorities(fn, keys.requires_grad_(), values, scorer.parameters())


def test_a_known_value_skips_the_forward_but_not_the_gradient():
    scorer = build_scorer("mlp", 1, 2, 8)
    keys, values = torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    calls = []

    def fn(k, v):
        calls.append(torch.is_grad_enabled())
        return sequence_priorities(scorer, 0, k, v, 4)

    params = list(scorer.parameters())
    first = checkpointed_priorities(fn, keys, values, params)
    again = checkpointed_priorities(fn, keys, values, params, known=first.detach())
    assert calls == [False]  # the known value was not recomputed in the forward
    torch.testing.assert_close(again, first, atol=0, rtol=0)
    g1 = torch.autograd.grad(first.sum(), params)
    g2 = torch.autograd.grad(again.sum(), params)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)
