"""KVpopTrainer on hybrid models: the scorer serves the KVpop (full-attention) layers only, the other layers and the
dense teacher attend as the model does (sliding window, softcap, sinks), and a short CPU retrofit of a tiny Gemma3
and a tiny GPT-OSS saves a checkpoint that records its layers, loads onto the model and generates."""

import json

import pytest
import torch
from transformers import DynamicCache

from hybrid_helpers import VOCAB, hybrid_model
from kvpop_hf import KVpopCache
from kvpop_hf.attention_variants import AttentionVariant, variant_attention
from kvpop_hf.compat import with_cache
from kvpop_hf.hub import CONFIG_NAME
from kvpop_hf.trainer import KVpopTrainer, KVpopTrainingArguments, StudentSettings, student_forward
from kvpop_hf.ops.targets import dense_causal_lse, future_attention_target, future_attention_target_reference

pytestmark = pytest.mark.tier("unit")

BUDGET = dict(sinks=2, window=4, topk=6)


def _ids(batch=2, length=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=g)


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "gpt_oss", "qwen2", "qwen3_next", "qwen3_5", "olmo3"])
def test_student_forward_matches_the_cache_and_the_teacher_matches_eager(name):
    model = hybrid_model(name)
    ids = _ids()
    cache = KVpopCache(model.config, scorer="mlp", log_gamma=-0.3, decay_step=4, **BUDGET)
    with torch.no_grad():
        expect = model(ids, **with_cache(model, cache)).logits
    model.set_attn_implementation("eager")
    with torch.no_grad():
        dense = model(ids, **with_cache(model, DynamicCache(config=model.config))).logits
    model.set_attn_implementation("kvpop_train")
    layers = cache.kvpop_config.layers
    for backend in ("flex", "dense"):
        st = StudentSettings(decay_step=4, backends={"train_attention": backend}, **BUDGET)
        with torch.no_grad():
            out, rec = student_forward(model, cache.scorer, st, cache.log_gamma, layers=layers, input_ids=ids)
        torch.testing.assert_close(out.logits, expect, atol=5e-5, rtol=0)
        assert sorted(rec.boundary) == cache.kvpop_layer_indices  # the scorer ran on the KVpop layers only
    with torch.no_grad():  # no student call: the dense teacher, as the model's own eager attention computes it
        teacher = model(ids).logits
    torch.testing.assert_close(teacher, dense, atol=5e-5, rtol=0)


def test_targets_with_softcap_and_sinks_match_the_reference():
    torch.manual_seed(0)
    b, hq, hkv, S, d, w = 2, 4, 2, 20, 8, 3
    q, k, v = torch.randn(b, hq, S, d), torch.randn(b, hkv, S, d), torch.randn(b, hkv, S, d)
    variant = AttentionVariant(softcap=1.5, sinks=torch.randn(hq))
    causal = torch.ones(S, S, dtype=torch.bool).tril()[None, None]
    _, lse = variant_attention(q, k, v, causal, 0.3, variant, return_lse=True)
    torch.testing.assert_close(dense_causal_lse(q, k, 0.3, chunk=7, softcap=1.5, sinks=variant.sinks), lse)
    ref = future_attention_target_reference(q, k, lse, w, scale=0.3, softcap=1.5)
    for backend in ("chunked", "flex"):
        got = future_attention_target(q, k, lse, w, scale=0.3, backend=backend, chunk=5, softcap=1.5)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    plain = future_attention_target_reference(q, k, lse, w, scale=0.3)
    assert not torch.allclose(plain, ref)  # the softcap matters at these sizes


@pytest.mark.parametrize("name", ["gemma3", "gpt_oss"])
def test_retrofit_saves_a_checkpoint_that_loads_and_generates(tmp_path, name):
    model = hybrid_model(name, attn="eager")
    data = [{"input_ids": r, "labels": r.clone()} for r in _ids(4, 32, seed=1)]
    args = KVpopTrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=2,
                                  learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to=[],
                                  use_cpu=True, disable_tqdm=True, seed=0, scorer="mlp", **BUDGET)
    trainer = KVpopTrainer(model=model, args=args, train_dataset=data)
    before = {k: v.clone() for k, v in trainer.scorer.state_dict().items()}
    trainer.train()
    assert any(not torch.equal(before[k], v) for k, v in trainer.scorer.state_dict().items())
    logged = [e for e in trainer.state.log_history if "boundary_loss" in e]
    assert logged and all(f"target_topk_recall/layer_{i}" in logged[0] for i in trainer.kvpop_config.layers)
    out = tmp_path / "scorer"
    trainer.save_model(str(out))
    saved = json.loads((out / CONFIG_NAME).read_text())
    model.set_attn_implementation("kvpop")
    fresh = KVpopCache(model.config, **BUDGET)
    assert saved["layers"] == fresh.kvpop_layer_indices and saved["layer_types"] == list(model.config.layer_types)
    assert saved["num_layers"] == len(saved["layers"]) < model.config.num_hidden_layers
    cache = KVpopCache.from_pretrained(out, model.config)
    for k, v in trainer.scorer.state_dict().items():
        assert torch.equal(cache.scorer.state_dict()[k], v.float())
    with torch.no_grad():
        gen = model.generate(_ids(1, 16), **with_cache(model, cache), max_new_tokens=12, do_sample=False)
    assert gen.shape == (1, 28)
    for i in cache.kvpop_layer_indices:
        assert bool(((cache.stored_positions(i) >= 0).sum(-1) == 12).all())  # B = 2 + 4 + 6


def test_checkpoint_onto_another_layer_pattern_is_refused(tmp_path):
    gemma = hybrid_model("gemma3")
    KVpopCache(gemma.config, scorer="mlp", **BUDGET).save_pretrained(tmp_path / "c")
    other = hybrid_model("gemma3", layer_types=["sliding_attention", "full_attention"] * 2)
    with pytest.raises(ValueError, match="layer pattern"):
        KVpopCache.from_pretrained(tmp_path / "c", other.config)
    qwen = hybrid_model("qwen2", use_sliding_window=False)  # 2 full-attention layers
    with pytest.raises(ValueError, match="layer"):
        KVpopCache.from_pretrained(tmp_path / "c", qwen.config)
    KVpopCache(qwen.config, scorer="mlp", **BUDGET).save_pretrained(tmp_path / "full")
    with pytest.raises(ValueError, match="all full attention"):
        KVpopCache.from_pretrained(tmp_path / "full", hybrid_model("gpt_oss").config)
    assert KVpopCache.from_pretrained(tmp_path / "c", gemma.config).kvpop_layer_indices == [3]


@pytest.mark.parametrize("chunk", [3, 1000])
def test_distillation_through_the_final_logit_softcap(chunk):
    """Gemma2's logits are ``c tanh(z / c)``: the chunked KL (value and hand-written gradients) and the logged LM loss
    see those, as the model's own logits."""
    from torch.nn import functional as F

    from kvpop_hf.trainer.chunked_distillation import chunked_distillation_loss, chunked_lm_loss
    from kvpop_hf.trainer.losses import distillation_loss
    from kvpop_hf.trainer.teacher_distillation import final_logit_softcap

    g = torch.Generator().manual_seed(0)
    h_s = torch.randn(2, 9, 16, generator=g).requires_grad_(True)
    h_t = torch.randn(2, 9, 16, generator=g)
    w = (torch.randn(37, 16, generator=g) * 2).requires_grad_(True)
    b = torch.randn(37, generator=g).requires_grad_(True)
    c = 3.0

    def capped(h):
        return torch.tanh(F.linear(h, w, b) / c) * c

    ref = distillation_loss(capped(h_s), capped(h_t), 1.5)
    got = chunked_distillation_loss(h_s, h_t, w, b, temperature=1.5, chunk_size=chunk, softcap=c)
    torch.testing.assert_close(got, ref)
    for a, r in zip(torch.autograd.grad(got, [h_s, w, b]), torch.autograd.grad(ref, [h_s, w, b])):
        torch.testing.assert_close(a, r, atol=1e-6, rtol=1e-5)
    labels = torch.randint(0, 37, (2, 9), generator=g)
    expect = F.cross_entropy(capped(h_s)[:, :-1].reshape(-1, 37), labels[:, 1:].reshape(-1))
    torch.testing.assert_close(chunked_lm_loss(h_s, w, b, labels, chunk_size=chunk, softcap=c), expect)
    assert final_logit_softcap(hybrid_model("gemma2")) == 30.0 and final_logit_softcap(hybrid_model("gpt_oss")) is None
