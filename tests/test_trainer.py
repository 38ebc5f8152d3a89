"""KVpopTrainer on tiny random-init models (CPU)."""

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import distinct_ids, tiny_model
from kvpop_hf import Backends, KVpopCache
from kvpop_hf.backends import CHOICES, env_var
from kvpop_hf.compat import with_cache
from kvpop_hf.trainer import KVpopTrainer, KVpopTrainingArguments, StudentSettings, student_forward

pytestmark = pytest.mark.tier("unit")

BUDGET = dict(sinks=2, window=5, topk=6)


def dataset(n=8, length=40, seed=0):
    ids = distinct_ids(n, length, seed=seed)
    return [{"input_ids": r, "labels": r.clone()} for r in ids]


def args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=3, learning_rate=1e-3,
                logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
                scorer="mlstm", scorer_kwargs='{"state_dim": 8}', **BUDGET)
    base.update(kw)
    return KVpopTrainingArguments(**base)


def test_student_forward_matches_cache():
    model = tiny_model("qwen3")
    ids = distinct_ids(2, 36)
    for scorer in ("mlp", "mlstm"):
        cache = KVpopCache(model.config, scorer=scorer, log_gamma=-0.3, decay_step=4, **BUDGET)
        with torch.no_grad():
            expect = model(ids, **with_cache(model, cache)).logits
        model.set_attn_implementation("kvpop_train")
        for backend in ("flex", "dense"):
            st = StudentSettings(decay_step=4, backends={"train_attention": backend}, **BUDGET)
            with torch.no_grad():
                out, rec = student_forward(model, cache.scorer, st, cache.log_gamma, input_ids=ids)
            got = out.logits
            torch.testing.assert_close(got, expect, atol=2e-5, rtol=0)
            assert set(rec.boundary) == {0, 1} and all(torch.isfinite(v) for v in rec.boundary.values())
        model.set_attn_implementation("kvpop")


def test_train_save_load_resume(tmp_path):
    model = tiny_model("qwen3", attn="sdpa")
    a = args(tmp_path, save_strategy="steps", save_steps=3)
    trainer = KVpopTrainer(model=model, args=a, train_dataset=dataset())
    before = copy.deepcopy(trainer.scorer.state_dict())
    trainer.train()
    logs = [e for e in trainer.state.log_history if "boundary_loss" in e]
    assert logs and all(k in logs[0] for k in ("distill_loss", "target_topk_recall", "target_topk_recall/layer_1",
                                               "loss"))
    assert any(not torch.equal(before[k], v) for k, v in trainer.scorer.state_dict().items())
    ckpt = tmp_path / "out" / "checkpoint-3"
    lm = AutoModelForCausalLM.from_pretrained(ckpt)
    cache = KVpopCache.from_pretrained(ckpt, lm.config)
    for k, v in trainer.scorer.state_dict().items():
        assert torch.equal(cache.scorer.state_dict()[k], v.float())
    assert json.loads((ckpt / "kvpop_config.json").read_text())["topk"] == BUDGET["topk"]
    lm.set_attn_implementation("kvpop")
    out = lm.generate(distinct_ids(1, 20), **with_cache(lm, cache), max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert out.shape[1] == 25
    # resume continues from the checkpoint with the same scorer weights
    model2 = tiny_model("qwen3", attn="sdpa", seed=1)
    t2 = KVpopTrainer(model=model2, args=args(tmp_path, max_steps=4), train_dataset=dataset())
    t2.train(resume_from_checkpoint=str(ckpt))
    assert t2.state.global_step == 4


def test_gradient_accumulation_scaling(tmp_path):
    def scorer_after(bs, ga):
        model = tiny_model("qwen3", attn="sdpa")
        a = args(tmp_path, per_device_train_batch_size=bs, gradient_accumulation_steps=ga, max_steps=1,
                 optim="sgd", learning_rate=1.0, max_grad_norm=0.0, lr_scheduler_type="constant")
        t = KVpopTrainer(model=model, args=a, train_dataset=dataset(n=4))
        t.train()
        return t.scorer.state_dict(), dict(t.model.named_parameters())["lm_head.weight"].detach()

    s1, w1 = scorer_after(4, 1)
    s2, w2 = scorer_after(2, 2)
    for k in s1:
        torch.testing.assert_close(s1[k], s2[k], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(w1, w2, atol=1e-5, rtol=1e-4)


def test_lora_student_uses_adapter_free_teacher(tmp_path):
    peft = pytest.importorskip("peft")
    model = tiny_model("qwen3", attn="sdpa")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    t = KVpopTrainer(model=lora, args=args(tmp_path, max_steps=2), train_dataset=dataset())
    assert t.teacher_model is None and t.is_peft
    t.train()
    assert "distill_loss" in t.state.log_history[0]


def test_scorer_only_training_learns_the_boundary(tmp_path):
    model = tiny_model("qwen3", attn="sdpa")
    data = dataset(n=2, length=48) * 8
    a = args(tmp_path, train_backbone=False, max_steps=30, learning_rate=1e-2, per_device_train_batch_size=2,
             scorer="mlp", scorer_kwargs="{}")
    before = copy.deepcopy(model.lm_head.weight.detach())
    t = KVpopTrainer(model=model, args=a, train_dataset=data)
    t.train()
    assert torch.equal(model.lm_head.weight.detach(), before)  # backbone frozen
    hist = [e for e in t.state.log_history if "boundary_loss" in e]
    first, last = sum(e["boundary_loss"] for e in hist[:5]) / 5, sum(e["boundary_loss"] for e in hist[-5:]) / 5
    assert last < first


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="learned scorer"):
        args(tmp_path, scorer="tova")
    with pytest.raises(ValueError, match="no parameters"):  # a fixed scorer alone has nothing to train
        args(tmp_path, scorer="knorm", train_backbone=False)
    with pytest.raises(ValueError, match="omega"):
        args(tmp_path, omega="nope")
    with pytest.raises(ValueError, match="window"):
        args(tmp_path, window=0)
    with pytest.raises(ValueError, match="non-reentrant"):
        args(tmp_path, gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True})
    a = args(tmp_path, gradient_checkpointing=True, gradient_checkpointing_kwargs='{"use_reentrant": false}')
    assert a.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert args(tmp_path, gradient_checkpointing=True).gradient_checkpointing_kwargs == {"use_reentrant": False}
    model = tiny_model("qwen3", attn="sdpa")
    t = KVpopTrainer(model=model, args=args(tmp_path), train_dataset=dataset())
    batch = {"input_ids": distinct_ids(2, 10), "attention_mask": torch.tensor([[1] * 10, [0] + [1] * 9])}
    with pytest.raises(ValueError, match="right-padded"):  # left padding
        t.compute_loss(t.model, batch)


def test_learned_decay_is_trained_and_saved(tmp_path):
    model = tiny_model("qwen3", attn="sdpa")
    a = args(tmp_path, train_backbone=False, log_gamma=-0.2, learn_decay=True, decay_step=4, max_steps=3,
             learning_rate=5e-2)
    t = KVpopTrainer(model=model, args=a, train_dataset=dataset())
    t.train()
    lg = t._log_gamma(t.model).detach()
    assert not torch.allclose(lg, torch.full_like(lg, -0.2))
    t.save_model(str(tmp_path / "final"))
    cache = KVpopCache.from_pretrained(tmp_path / "final")
    torch.testing.assert_close(cache.log_gamma, lg.float())


def test_max_target_trains_and_bad_combinations(tmp_path):
    with pytest.raises(ValueError, match="target_reduce: reduce must be 'mean', 'max' or 'p<x>'"):
        args(tmp_path, target_reduce="sum")
    with pytest.raises(ValueError, match="chunked target pass"):
        args(tmp_path, target_reduce="p4", backends={"target_pass": "flex"})
    with pytest.raises(ValueError, match="chunked target pass"):
        args(tmp_path, target_reduce="max", backends='{"target_pass": "flex"}')
    model = tiny_model("qwen3", attn="sdpa")
    data = dataset(n=2, length=48) * 8
    a = args(tmp_path, train_backbone=False, max_steps=30, learning_rate=1e-2, scorer="mlp", scorer_kwargs="{}",
             target_reduce="max")
    t = KVpopTrainer(model=model, args=a, train_dataset=data)
    assert t.settings.target_reduce == "max"
    t.train()
    hist = [e for e in t.state.log_history if "boundary_loss" in e]
    first, last = sum(e["boundary_loss"] for e in hist[:5]) / 5, sum(e["boundary_loss"] for e in hist[-5:]) / 5
    assert last < first


def test_student_forward_uses_the_max_target(monkeypatch):
    """The setting reaches the target pass of every layer, and the boundary loss is built from its output."""
    import kvpop_hf.trainer.student as student

    model = tiny_model("qwen3")
    ids = distinct_ids(2, 48)
    cache = KVpopCache(model.config, scorer="mlp", **BUDGET)
    model.set_attn_implementation("kvpop_train")
    real = student.future_attention_target
    calls = []

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append((kwargs.get("reduce", "mean"), args, kwargs, out))
        return out

    monkeypatch.setattr(student, "future_attention_target", spy)
    losses = {}
    for reduce in ("mean", "max", "p4"):
        calls.clear()
        st = StudentSettings(backends={"train_attention": "dense"}, target_reduce=reduce, **BUDGET)
        with torch.no_grad():
            _, rec = student_forward(model, cache.scorer, st, None, input_ids=ids)
        losses[reduce] = torch.stack([rec.boundary[i] for i in sorted(rec.boundary)])
        assert [c[0] for c in calls] == [reduce] * len(model.model.layers)
        if reduce == "max":  # the same inputs with the mean give a target that is never above the max one
            for _, args, kwargs, out in calls:
                mean_target = real(*args, **{**kwargs, "reduce": "mean"})
                assert bool((out[0] >= mean_target[0] - 1e-5).all())
    assert not torch.allclose(losses["mean"], losses["max"])  # a different target, a different loss
    assert not torch.allclose(losses["p4"], losses["max"]) and not torch.allclose(losses["p4"], losses["mean"])


def test_retrofit_names_the_train_extra_when_peft_is_missing(tmp_path, monkeypatch):
    import sys

    from kvpop_hf.cli import retrofit

    monkeypatch.setitem(sys.modules, "peft", None)  # import peft -> ImportError
    with pytest.raises(ImportError, match=r"\[train\]"):
        retrofit.main(["--model", str(tmp_path / "never_loaded"), "--lora_rank", "4", "--output_dir",
                       str(tmp_path / "out"), "--use_cpu", "True", "--report_to", "none"])


def test_mlstm_has_one_token_readout_default(tmp_path):
    """The scorer class and the trainer share one default (token_readout=True); the paper's readout is asked for."""
    from kvpop_hf.scorers import build_scorer

    assert build_scorer("mlstm", 2, 2, 8).token_readout is True
    assert json.loads(args(tmp_path, scorer_kwargs="{}").scorer_kwargs) == {}
    paper = args(tmp_path, scorer_kwargs='{"token_readout": false, "state_dim": 8}')
    assert json.loads(paper.scorer_kwargs) == {"token_readout": False, "state_dim": 8}
    cfg = paper.kvpop_config(tiny_model("qwen3").config)
    assert build_scorer(cfg.scorer, 2, 2, 8, **cfg.scorer_kwargs).token_readout is False


def test_a_checkpoint_of_the_other_readout_names_the_fix(tmp_path):
    from kvpop_hf import KVpopCache

    model = tiny_model("qwen3")
    KVpopCache(model.config, sinks=1, window=4, topk=3, scorer="mlstm",
               scorer_kwargs={"token_readout": False}).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "kvpop_config.json").read_text())
    cfg["scorer_kwargs"].pop("token_readout", None)  # a config that does not name the option
    (tmp_path / "kvpop_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r'add "token_readout": false'):
        KVpopCache.from_pretrained(tmp_path, model.config)


def test_the_trainer_takes_its_backends_from_the_record(tmp_path, monkeypatch):
    """args.backends (a Backends, a dict or JSON): a bad choice is refused with the allowed values when the
    arguments are built; KVPOP_<FIELD> gives the default, an explicit field wins; the trainer resolves the record
    once, for args.device, before it touches the model, and a later change of the environment reaches nothing."""
    import kvpop_hf.ops.running_topk as topk

    for name in CHOICES:
        monkeypatch.delenv(env_var(name), raising=False)
    with pytest.raises(ValueError, match=r"Backends\(running_topk=...\) must be one of \('auto', 'torch', 'wavelet', "
                                         r"'triton'\), got 'fenwick'"):
        args(tmp_path, backends={"running_topk": "fenwick"})
    with pytest.raises(ValueError, match=r"Unknown backends \['attention_backend'\]; the choices are"):
        args(tmp_path, backends='{"attention_backend": "flex"}')
    with pytest.raises(ValueError, match="backends must be a JSON object"):
        args(tmp_path, backends="running_topk=torch")
    monkeypatch.setenv("KVPOP_TRAIN_ATTENTION", "sparse")
    with pytest.raises(ValueError, match=r"KVPOP_TRAIN_ATTENTION must be one of \('auto', 'dense', 'flex'\)"):
        args(tmp_path)

    monkeypatch.setenv("KVPOP_TRAIN_ATTENTION", "flex")
    from transformers import HfArgumentParser  # the command line's flag (kvpop-retrofit --backends JSON)

    parsed, = HfArgumentParser(KVpopTrainingArguments).parse_args_into_dataclasses(
        args=["--output_dir", str(tmp_path), "--scorer", "mlp", "--backends", '{"target_pass": "flex"}'])
    assert parsed.backends == {"target_pass": "flex"}
    a = args(tmp_path, backends=Backends(running_topk="wavelet"))
    assert a.backends == {"running_topk": "wavelet"}  # kept as the given fields: TrainingArguments stay JSON
    json.loads(a.to_json_string())
    trainer = KVpopTrainer(model=tiny_model("qwen3", attn="sdpa"), args=a, train_dataset=dataset())
    assert trainer.settings.backends == Backends(running_topk="wavelet", train_attention="flex", target_pass="chunked",
                                                 _train_block_mask="interval")
    explicit = KVpopTrainer(model=tiny_model("qwen3", attn="sdpa"), train_dataset=dataset(),
                            args=args(tmp_path, backends={"train_attention": "dense"}))
    assert explicit.settings.backends.train_attention == "dense"

    monkeypatch.setenv("KVPOP_RUNNING_TOPK", "torch")  # read at resolve time only: the trainer keeps its wavelet
    calls = []
    wavelet = topk.running_topk_wavelet
    monkeypatch.setattr(topk, "running_topk_wavelet", lambda *a: calls.append("wavelet") or wavelet(*a))
    with torch.no_grad():
        trainer.compute_loss(trainer.model, trainer.data_collator(dataset(n=1)))
    assert calls and set(calls) == {"wavelet"}

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = tiny_model("qwen3", attn="sdpa")
    with pytest.raises(RuntimeError, match=r"running_topk backend 'triton' runs on CUDA.*KVPOP_RUNNING_TOPK=torch"):
        KVpopTrainer(model=model, args=args(tmp_path, backends={"running_topk": "triton"}), train_dataset=dataset())
    assert not hasattr(model, "kvpop_scorer")  # refused before any work
