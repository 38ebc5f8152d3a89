"""The student forward's state belongs to its call (forward keyword), not to the module or the process."""

import threading

import pytest
import torch

from helpers import distinct_ids, tiny_model
from kvpop_hf import KVpopCache
from kvpop_hf.trainer import StudentSettings, student_forward

pytestmark = pytest.mark.tier("unit")

SETTINGS = {"a": StudentSettings(sinks=2, window=5, topk=6, backends={"train_attention": "dense"}),
            "b": StudentSettings(sinks=1, window=3, topk=2, backends={"train_attention": "dense"})}


@pytest.fixture(params=["qwen3", "llama"])
def setup(request):
    model = tiny_model(request.param)
    scorer = KVpopCache(model.config, scorer="mlp", **{"sinks": 2, "window": 5, "topk": 6}).scorer
    model.set_attn_implementation("kvpop_train")
    return model, scorer, distinct_ids(2, 40)


def _run(model, scorer, ids, name):
    with torch.no_grad():
        out, rec = student_forward(model, scorer, SETTINGS[name], input_ids=ids)
    return out.logits, torch.stack([rec.boundary[i] for i in sorted(rec.boundary)])


def test_two_threads_give_what_each_gives_alone(setup):
    model, scorer, ids = setup
    alone = {n: _run(model, scorer, ids, n) for n in SETTINGS}
    assert not torch.allclose(alone["a"][0], alone["b"][0])  # the settings matter
    barrier = threading.Barrier(2, timeout=60)

    def meet(*_):
        barrier.wait()
    hook = model.model.layers[1].register_forward_pre_hook(meet)
    got, errors = {}, []

    def work(name):
        try:
            got[name] = _run(model, scorer, ids, name)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    try:
        threads = [threading.Thread(target=work, args=(n,)) for n in SETTINGS]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        hook.remove()
    assert not errors, errors
    for n in SETTINGS:  # both forwards were inside layer 1 at once (barrier), each with its own state
        torch.testing.assert_close(got[n][0], alone[n][0], atol=1e-6, rtol=0)
        torch.testing.assert_close(got[n][1], alone[n][1], atol=1e-6, rtol=0)


def test_an_exception_inside_the_forward_leaves_no_state(setup):
    model, scorer, ids = setup
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        dense = model(ids).logits
    model.set_attn_implementation("kvpop_train")
    alone = _run(model, scorer, ids, "a")

    def fail(*_):
        raise RuntimeError("planted")
    hook = model.model.layers[1].register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="planted"):
        _run(model, scorer, ids, "a")
    hook.remove()
    with torch.no_grad():
        plain = model(ids).logits  # no student state left behind: plain causal attention
    torch.testing.assert_close(plain, dense, atol=1e-5, rtol=0)
    again = _run(model, scorer, ids, "a")
    torch.testing.assert_close(again[0], alone[0], atol=1e-6, rtol=0)


def test_gradient_checkpointing_recomputes_the_student(setup, monkeypatch):
    """The recomputation in backward replays the layer with the same keywords: it runs the scorer, the sparse
    attention and the boundary loss again (same gradients, scorer included) but reuses the layer's running
    top-k results and target instead of computing them twice."""
    import kvpop_hf.trainer.student as student_module

    model, scorer, ids = setup
    calls = {"topk": 0, "target": 0}

    def counted(name, fn):
        def wrapper(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return wrapper

    monkeypatch.setattr(student_module, "running_topk", counted("topk", student_module.running_topk))
    monkeypatch.setattr(student_module, "future_attention_target",
                        counted("target", student_module.future_attention_target))
    model.train()
    scorer.requires_grad_(True)
    grads, counts = [], []
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.zero_grad(set_to_none=True)
        scorer.zero_grad(set_to_none=True)
        calls.update(topk=0, target=0)
        out, rec = student_forward(model, scorer, SETTINGS["a"], input_ids=ids, use_cache=False)
        (out.logits.square().mean() + torch.stack(list(rec.boundary.values())).sum()).backward()
        counts.append(dict(calls))
        named = list(model.named_parameters()) + [(f"scorer.{n}", p) for n, p in scorer.named_parameters()]
        grads.append({n: p.grad.clone() for n, p in named if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any(n.startswith("scorer.") for n in grads[0])
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=1e-5, rtol=1e-4)
    layers = model.config.num_hidden_layers
    assert counts[0] == counts[1] == {"topk": 2 * layers, "target": layers}, counts


def test_a_model_without_the_student_attention_is_refused(setup):
    model, scorer, ids = setup
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="set_attn_implementation"):
        _run(model, scorer, ids, "a")
