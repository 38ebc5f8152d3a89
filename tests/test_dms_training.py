"""DMS training pieces: the relaxed mask against its reference and the hard rule, the relaxation, the penalty and
schedule, the training forward, and the errors."""

import pytest
import torch

import kvpop_hf  # noqa: F401
from helpers import distinct_ids, tiny_model
from kvpop_hf.baselines.dms import CompressionSchedule, DMSGate, compression_loss, mean_eviction, target_eviction_rate
from kvpop_hf.baselines.dms.mask import hard_visibility, soft_eviction_bias
from references import hard_visibility_reference, soft_eviction_bias_reference
from kvpop_hf.baselines.dms.relaxation import eviction_probability, log_keep, relaxed_logits
from kvpop_hf.baselines.dms.train_attention import TRAIN_ATTN_NAME, dms_forward

pytestmark = pytest.mark.tier("unit")


@pytest.mark.parametrize("sinks,window", [(0, 1), (2, 3), (1, 7)])
def test_soft_bias_equals_reference(sinks, window):
    torch.manual_seed(0)
    lk = -torch.rand(2, 3, 9) * 4
    torch.testing.assert_close(soft_eviction_bias(lk, sinks, window), soft_eviction_bias_reference(lk, sinks, window))


def test_hard_visibility_equals_reference_and_soft_bias_at_hard_decisions():
    g = torch.Generator().manual_seed(1)
    evict = torch.rand(2, 3, 11, generator=g) > 0.5
    qpos = torch.arange(11).expand(2, 11).clone()
    qpos[1, :3] = -1
    kpos = torch.arange(11).expand(2, 3, 11)
    vis = hard_visibility(qpos, kpos, evict, 2, 4)
    assert torch.equal(vis, hard_visibility_reference(qpos, kpos, evict, 2, 4))
    # alpha exactly 0 / 1 -> log(1 - alpha) = 0 / -inf: the relaxed bias hides exactly what the hard rule hides
    lk = torch.where(evict, float("-inf"), 0.0)
    bias = soft_eviction_bias(lk, 2, 4)
    assert torch.equal(bias[0] > float("-inf"), vis[0])


def test_relaxation():
    logits = torch.tensor([-3.0, 0.0, 2.0])
    z = relaxed_logits(logits.expand(20000, 3), temperature=0.3, generator=torch.Generator().manual_seed(0))
    freq = (eviction_probability(z) > 0.5).float().mean(0)
    torch.testing.assert_close(freq, torch.sigmoid(logits), atol=0.01, rtol=0)  # P(alpha > 1/2) = sigmoid(logit)
    z = torch.tensor([-200.0, 0.0, 200.0])
    torch.testing.assert_close(log_keep(z).exp(), 1 - torch.sigmoid(z))
    assert torch.isfinite(log_keep(z)).all()
    with pytest.raises(ValueError, match="temperature"):
        relaxed_logits(logits, temperature=0.0)


def test_compression_target_schedule_and_penalty():
    # mean memory after L tokens = s + w + (1 - r)(L - s - w) = B
    for B in (256, 123, 61):
        r = target_eviction_rate(B, 1024, 4, 32)
        assert abs(4 + 32 + (1 - r) * (1024 - 36) - B) < 1e-9
    sched = CompressionSchedule(0.8, 10)
    assert [sched.rate(s) for s in (0, 5, 10, 50)] == [0.0, 0.4, 0.8, 0.8]
    a = [torch.tensor([[[0.9, 0.9, 0.2, 0.4]]]), torch.tensor([[[0.0, 0.0, 0.6, 0.8]]])]
    m = mean_eviction(a, sinks=2)
    torch.testing.assert_close(m, torch.tensor(0.5))
    assert float(compression_loss(m, 0.7)) == pytest.approx(0.2)
    assert float(compression_loss(m, 0.3)) == 0.0
    assert float(compression_loss(m, 0.3, two_sided=True)) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="between"):
        target_eviction_rate(20, 1024, 4, 32)
    with pytest.raises(ValueError, match="final eviction rate"):
        CompressionSchedule(1.0, 5)
    with pytest.raises(ValueError, match="No eviction decisions"):
        mean_eviction([], 0)


def test_training_forward_matches_hard_rule_and_gives_gate_gradients():
    model = tiny_model(layers=2)
    cfg = model.config
    gate = DMSGate(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, init_bias=0.0)
    ids = distinct_ids(2, 16)
    model.set_attn_implementation(TRAIN_ATTN_NAME)
    with torch.no_grad():
        dense = model(ids).logits  # no DMS keyword: plain causal attention (the teacher)
    out, rec = dms_forward(model, gate, 2, 4, temperature=0.5, input_ids=ids)
    assert sorted(rec.alpha) == [0, 1] and rec.alpha[0].shape == (2, 2, 16)
    loss = compression_loss(mean_eviction(list(rec.alpha.values()), 2), 0.9) + out.logits.float().pow(2).mean()
    loss.backward()
    assert gate.weight.grad is not None and gate.bias.grad.abs().sum() > 0
    # a gate that never evicts (very negative logits) reproduces the dense model
    with torch.no_grad():
        gate.bias.fill_(-60.0)
        out, _ = dms_forward(model, gate, 2, 4, temperature=0.5, noise=False, input_ids=ids)
    torch.testing.assert_close(out.logits, dense, atol=2e-5, rtol=1e-4)
    model.set_attn_implementation("kvpop")
    with pytest.raises(ValueError, match="dms_train"):
        dms_forward(model, gate, 2, 4, temperature=0.5, input_ids=ids)


@pytest.mark.parametrize("kwargs,match", [({"penalty": "both"}, "penalty"), ({"ramp_fraction": 1.5}, "ramp_fraction"),
                                          ({"target_eviction": 1.0}, "target_eviction"), ({"window": 0}, "window"),
                                          ({"gate_temperature": 0.0}, "gate_temperature")])
def test_training_arguments_refuse_bad_values(tmp_path, kwargs, match):
    from kvpop_hf.baselines.dms.trainer import DMSTrainingArguments

    with pytest.raises(ValueError, match=match):
        DMSTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kwargs)


def test_time_ramp_follows_the_clock(monkeypatch):
    from types import SimpleNamespace

    from kvpop_hf.baselines.dms import trainer as dms_trainer

    clock = [100.0]
    monkeypatch.setattr(dms_trainer.time, "monotonic", lambda: clock[0])
    fake = SimpleNamespace(args=SimpleNamespace(ramp_seconds=10.0, target_eviction=0.8), _ramp_start=None,
                           schedule=CompressionSchedule(0.8, 1000), state=SimpleNamespace(global_step=5))
    rates = []
    for t in (100.0, 105.0, 110.0, 150.0):  # the ramp starts at the first call
        clock[0] = t
        rates.append(dms_trainer.DMSTrainer.target_rate(fake))
    assert rates == pytest.approx([0.0, 0.4, 0.8, 0.8])
    fake.args.ramp_seconds = None  # by step: 5 of 1000 ramp steps
    assert dms_trainer.DMSTrainer.target_rate(fake) == pytest.approx(0.004)


def test_train_dms_knobs_shape_the_data_and_the_time_budget_sets_the_ramp(tmp_path):

    from test_streaming_plus import _teacher

    from kvpop_lab.testbed import build_tokenizer

    from kvpop_hf.cli import train_dms

    teacher = _teacher(tmp_path)
    common = ["--model", str(teacher), "--seq_len", "256", "--compression", "0.75", "--sinks", "4", "--window", "16",
              "--output_dir", str(tmp_path / "ck"), "--report_to", "none", "--save_strategy", "no", "--use_cpu", "True",
              "--disable_tqdm", "True", "--per_device_train_batch_size", "2"]
    trainer = train_dms.train(common + ["--max_steps", "1", "--max_train_seconds", "60", "--ramp_fraction", "0.5",
                                       "--knob", "reasoning.n_facts=3", "reasoning.steps=2"])
    fact = build_tokenizer().convert_tokens_to_ids("fact")
    assert [int((e["input_ids"] == fact).sum()) for e in trainer.train_dataset] == [3, 3]
    assert trainer.args.ramp_seconds == pytest.approx(30.0)
    with pytest.raises(ValueError, match="FAMILY.KEY=VALUE"):  # before the model is loaded
        train_dms.main(["--model", str(tmp_path / "nothing")] + common[2:] + ["--knob", "steps=4"])
