"""The chunked distillation loss equals ``losses.distillation_loss`` on the logits, in value and gradient."""

import copy

import pytest
import torch
from torch import nn

from kvpop_hf.trainer.chunked_distillation import chunked_distillation_loss, default_chunk_size
from kvpop_hf.trainer.hidden_states import final_hidden_states, lm_head_of
from kvpop_hf.trainer.losses import distillation_loss

pytestmark = pytest.mark.tier("unit")

RTOL = 1e-5


def _close(a, b, rtol=RTOL):
    scale = b.abs().max().clamp_min(1e-12)
    assert ((a - b).abs().max() / scale).item() < rtol, ((a - b).abs().max().item(), scale.item())


def _inputs(seed=0, B=2, S=13, H=16, V=37, bias=False):
    g = torch.Generator().manual_seed(seed)
    h_s = torch.randn(B, S, H, generator=g, dtype=torch.float64).float().requires_grad_(True)
    h_t = torch.randn(B, S, H, generator=g)
    w = (torch.randn(V, H, generator=g) * 0.5).requires_grad_(True)
    b = (torch.randn(V, generator=g) * 0.1).requires_grad_(True) if bias else None
    mask = torch.rand(B, S, generator=g) > 0.3
    return h_s, h_t, w, b, mask


def _reference(h_s, h_t, w, b, T, mask, w_t=None, b_t=None):
    w_t = w if w_t is None else w_t
    b_t = b if w_t is w else b_t
    zs = nn.functional.linear(h_s, w, b)
    zt = nn.functional.linear(h_t, w_t, b_t)
    return distillation_loss(zs, zt, T, mask)


@pytest.mark.parametrize("T", [1.0, 2.5])
@pytest.mark.parametrize("chunk", [1, 4, 1000])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_value_and_gradients_match_reference(T, chunk, bias, masked):
    h_s, h_t, w, b, mask = _inputs(bias=bias)
    mask = mask if masked else None
    ref = _reference(h_s, h_t, w, b, T, mask)
    params = [h_s, w] + ([b] if bias else [])
    ref_grads = torch.autograd.grad(ref, params)
    got = chunked_distillation_loss(h_s, h_t, w, b, temperature=T, mask=mask, chunk_size=chunk)
    got_grads = torch.autograd.grad(got, params)
    assert got.dtype == torch.float32
    _close(got.detach(), ref.detach())
    for g, r in zip(got_grads, ref_grads):
        _close(g, r)


def test_separate_teacher_head_and_frozen_student_head():
    h_s, h_t, w, _, mask = _inputs(seed=1)
    w_t = (w.detach() + 0.05 * torch.randn_like(w)).requires_grad_(True)
    w_frozen = w.detach()  # a LoRA student's head: no gradient wanted
    ref = _reference(h_s, h_t, w_frozen, None, 1.7, mask, w_t=w_t)
    got = chunked_distillation_loss(h_s, h_t, w_frozen, teacher_head_weight=w_t, temperature=1.7, mask=mask,
                                    chunk_size=5)
    _close(got.detach(), ref.detach())
    (g_ref,) = torch.autograd.grad(ref, [h_s])
    (g_got,) = torch.autograd.grad(got, [h_s])
    _close(g_got, g_ref)
    assert w_t.grad is None  # the teacher is a fixed target


def test_gradient_scales_with_the_upstream_gradient():
    h_s, h_t, w, _, mask = _inputs(seed=2)
    (g1,) = torch.autograd.grad(chunked_distillation_loss(h_s, h_t, w, mask=mask), [h_s])
    (g3,) = torch.autograd.grad(3.0 * chunked_distillation_loss(h_s, h_t, w, mask=mask), [h_s])
    _close(g3, 3.0 * g1)


def test_empty_mask_is_zero_and_attached():
    h_s, h_t, w, _, mask = _inputs(seed=3)
    z = chunked_distillation_loss(h_s, h_t, w, mask=torch.zeros_like(mask))
    assert z.item() == 0.0 and z.requires_grad


def test_identical_is_zero():
    h_s, _, w, _, _ = _inputs(seed=4)
    assert abs(chunked_distillation_loss(h_s, h_s.detach().clone(), w).item()) < 1e-6


def test_bad_input_raises():
    h_s, h_t, w, _, mask = _inputs(seed=5)
    with pytest.raises(ValueError, match="shape mismatch"):
        chunked_distillation_loss(h_s, h_t[:, :-1], w)
    with pytest.raises(ValueError, match="head_weight"):
        chunked_distillation_loss(h_s, h_t, w[:, :-1])
    with pytest.raises(ValueError, match="mask"):
        chunked_distillation_loss(h_s, h_t, w, mask=mask[:, :-1])
    with pytest.raises(ValueError, match="temperature"):
        chunked_distillation_loss(h_s, h_t, w, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_distillation_loss(h_s, h_t, w, chunk_size=0)
    assert default_chunk_size(151936) == (1 << 27) // 151936


# -- whole models: frozen-copy teacher and PEFT teacher (adapters disabled) -------------------------------
def _tiny_model(seed=0):
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # peaked distributions, as a trained head gives (KL well above roundoff)
    return model


def _model_inputs(seed=0, S=11):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (2, S), generator=g)
    mask = torch.rand(2, S, generator=g) > 0.25
    return ids, mask


def _compare_models(student, teacher, params, T=2.0):
    ids, mask = _model_inputs()
    ref = distillation_loss(student(input_ids=ids).logits, teacher(input_ids=ids).logits.detach(), T, mask)
    ref_grads = torch.autograd.grad(ref, params)
    _, h_s = final_hidden_states(student, input_ids=ids)
    with torch.no_grad():
        _, h_t = final_hidden_states(teacher, input_ids=ids)
    head_s, head_t = lm_head_of(student), lm_head_of(teacher)
    got = chunked_distillation_loss(h_s, h_t, head_s.weight, head_s.bias, teacher_head_weight=head_t.weight,
                                    teacher_head_bias=head_t.bias, temperature=T, mask=mask, chunk_size=7)
    got_grads = torch.autograd.grad(got, params)
    _close(got.detach(), ref.detach())
    for g, r in zip(got_grads, ref_grads):
        _close(g, r)


def test_frozen_copy_teacher_model():
    student = _tiny_model(0)
    teacher = copy.deepcopy(student).requires_grad_(False)
    with torch.no_grad():  # the student has drifted from its teacher, head included
        for p in student.parameters():
            p.add_(0.05 * torch.randn_like(p))
    params = [p for p in student.parameters() if p.requires_grad]
    _compare_models(student, teacher, params)


def test_peft_teacher_is_the_student_without_adapters():
    peft = pytest.importorskip("peft")
    student = peft.get_peft_model(_tiny_model(1), peft.LoraConfig(r=4, lora_alpha=8,
                                                                   target_modules=["q_proj", "k_proj", "v_proj"]))
    with torch.no_grad():
        for n, p in student.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 1.0)  # a trained adapter (peft initialises B to 0)
    params = [p for p in student.parameters() if p.requires_grad]
    ids, mask = _model_inputs()
    ref_s = student(input_ids=ids).logits
    with torch.no_grad(), student.disable_adapter():
        ref_t = student(input_ids=ids).logits
    ref = distillation_loss(ref_s, ref_t, 2.0, mask)
    ref_grads = torch.autograd.grad(ref, params)
    _, h_s = final_hidden_states(student, input_ids=ids)
    with torch.no_grad(), student.disable_adapter():
        _, h_t = final_hidden_states(student, input_ids=ids)
    head = lm_head_of(student)
    got = chunked_distillation_loss(h_s, h_t, head.weight, temperature=2.0, mask=mask, chunk_size=3)
    got_grads = torch.autograd.grad(got, params)
    assert ref.item() > 0.05  # the adapters change the distribution
    _close(got.detach(), ref.detach())
    for g, r in zip(got_grads, ref_grads):
        _close(g, r)


def test_chunked_lm_loss_matches_cross_entropy():
    from kvpop_hf.trainer.chunked_distillation import chunked_lm_loss

    h, _, w, b, _ = _inputs(seed=6, bias=True)
    labels = torch.randint(0, w.shape[0], h.shape[:2])
    labels[0, :4] = -100
    logits = nn.functional.linear(h, w, b)
    ref = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    _close(chunked_lm_loss(h, w, b, labels, chunk_size=3), ref.detach())
