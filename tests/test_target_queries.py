"""The future-attention target restricted to some queries (``query_mask``): backends against the brute-force
reference, the trainer's ``target_queries="labels"`` and the oracle's target queries."""

import pytest
import torch

from helpers import distinct_ids, tiny_model
from kvpop_lab.testbed.oracle import target_queries
from kvpop_hf.trainer import KVpopTrainer, KVpopTrainingArguments
from kvpop_hf.ops.targets import dense_causal_lse, future_attention_target, future_attention_target_reference

pytestmark = pytest.mark.tier("unit")


def _qkl(B=2, Hq=4, Hkv=2, S=37, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, Hq, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    return q, k, dense_causal_lse(q, k)


@pytest.mark.parametrize("reduce", ["mean", "max"])
@pytest.mark.parametrize("window", [1, 5])
def test_masked_target_matches_reference(reduce, window):
    q, k, lse = _qkl()
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(2, 37, generator=g) < 0.3
    mask[1] = False
    mask[1, 30:33] = True  # row 1: only queries 30-32 count
    ref = future_attention_target_reference(q, k, lse, window, reduce=reduce, query_mask=mask)
    backends = ["chunked"] + (["flex"] if reduce == "mean" else [])
    for backend in backends:
        got = future_attention_target(q, k, lse, window, backend=backend, chunk=7, reduce=reduce, query_mask=mask)
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    # keys whose every later query is unmarked get log(eps), whatever the backend
    assert torch.allclose(ref[1, :, 33 - window:], torch.log(torch.tensor(1e-6)))
    assert (ref[1, :, :33 - window] > torch.log(torch.tensor(1e-6))).all()


def test_all_true_mask_is_the_plain_target():
    q, k, lse = _qkl(seed=3)
    mask = torch.ones(2, 37, dtype=torch.bool)
    for reduce in ("mean", "max"):
        plain = future_attention_target(q, k, lse, 4, backend="chunked", reduce=reduce)
        masked = future_attention_target(q, k, lse, 4, backend="chunked", reduce=reduce, query_mask=mask)
        torch.testing.assert_close(masked, plain)


def test_query_mask_shape_and_dtype_errors():
    q, k, lse = _qkl()
    with pytest.raises(ValueError, match="query_mask must be a bool tensor"):
        future_attention_target(q, k, lse, 4, backend="chunked", query_mask=torch.ones(2, 36, dtype=torch.bool))
    with pytest.raises(ValueError, match="query_mask must be a bool tensor"):
        future_attention_target(q, k, lse, 4, backend="chunked", query_mask=torch.ones(2, 37))


def test_target_queries_marks_the_positions_that_predict_a_label():
    labels = torch.tensor([[-100, -100, -100, 7, 8, -100]])
    assert target_queries(labels).tolist() == [[False, False, True, True, False, False]]


def test_trainer_labels_target_reaches_every_layer(tmp_path, monkeypatch):
    import kvpop_hf.trainer.student as student

    real, seen = student.future_attention_target, []

    def spy(*a, **kw):
        seen.append(kw.get("query_mask"))
        return real(*a, **kw)

    monkeypatch.setattr(student, "future_attention_target", spy)
    ids = distinct_ids(4, 40)
    labels = ids.clone()
    labels[:, :30] = -100  # the last 10 tokens are the supervised answer
    data = [{"input_ids": i, "labels": l} for i, l in zip(ids, labels)]
    model = tiny_model("qwen3", attn="sdpa")
    common = dict(output_dir=str(tmp_path / "o"), per_device_train_batch_size=2, max_steps=1, report_to=[],
                  use_cpu=True, disable_tqdm=True, save_strategy="no", scorer="mlp", scorer_kwargs="{}",
                  train_backbone=False, sinks=2, window=5, topk=6)
    with pytest.raises(ValueError, match="target_queries must be"):
        KVpopTrainingArguments(**common, target_queries="answer")
    t = KVpopTrainer(model=model, args=KVpopTrainingArguments(**common, target_queries="labels"), train_dataset=data)
    t.train()
    assert seen and len(seen) == len(model.model.layers)
    for m in seen:
        assert m is not None and m.shape == (2, 40)
        assert not m[:, :29].any() and m[:, 29:39].all() and not m[:, 39].any()
