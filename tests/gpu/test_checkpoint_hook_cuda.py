"""The checkpoint hook (kvpop_hf/hub_generate.py) on CUDA: ``generate`` runs the run-ahead loop with fused q/k/v and
gate/up projections and ``fused_compile_config()``, and gives the tokens of that path spelt out by hand; for a
full folder through ``from_pretrained(dir, trust_remote_code=True)``, for a shipped LoRA student through
``custom_generate=adapter_dir``. Prompts are longer than the budget (eviction) and than the prefill chunk."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvpop_hf import KVpopCache, fuse_projection_storage, fused_compile_config, prefill_in_chunks, run_ahead_sample
from kvpop_hf.compat import with_cache
from kvpop_hf.ops.fused_projections import SharedStorageLinear

pytestmark = pytest.mark.tier("unit")

ROOT = Path(__file__).resolve().parents[2]


def _fastest_by_hand(folder, prompt, chunk, new):
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="kvpop").to("cuda")
    fuse_projection_storage(model)
    cache = KVpopCache.from_pretrained(folder, model.config)
    prefill_in_chunks(model, cache, prompt, chunk)
    return model.generate(prompt, **with_cache(model, cache, max_new_tokens=new, do_sample=False,
                                               custom_generate=run_ahead_sample, compile_config=fused_compile_config()))


def _eager_by_hand(folder, prompt, chunk, new):
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="kvpop").to("cuda")
    cache = KVpopCache.from_pretrained(folder, model.config)
    prefill_in_chunks(model, cache, prompt, chunk)
    return model.generate(prompt, **with_cache(model, cache, max_new_tokens=new, do_sample=False,
                                               disable_compile=True))


def _cache_of(result):
    return getattr(result, "cache", None) or result.past_key_values


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from kvpop_lab.tiny_models import tiny_model
    from kvpop_hf.trainer import KVpopTrainer, KVpopTrainingArguments

    out = tmp_path_factory.mktemp("kvpop_full")
    args = KVpopTrainingArguments(output_dir=str(out), max_steps=0, report_to=[], use_cpu=True, save_strategy="no",
                                  scorer="mlp", sinks=2, window=8, topk=16)
    KVpopTrainer(model=tiny_model("qwen3", attn="sdpa"), args=args).save_model(str(out))
    return out


def test_a_full_folder_decodes_on_the_fastest_path(saved):
    model = AutoModelForCausalLM.from_pretrained(saved, trust_remote_code=True).to("cuda")
    assert isinstance(model.generate, functools.partial)
    prompt = torch.randint(1, model.config.vocab_size, (1, 100), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(0))
    result = model.generate(prompt, max_new_tokens=12, do_sample=False, return_dict_in_generate=True,
                            prefill_chunk_size=32)
    assert isinstance(_cache_of(result), KVpopCache) and _cache_of(result).kvpop_config.budget == 26
    assert any(isinstance(m, SharedStorageLinear) for m in model.modules())
    assert torch.equal(result.sequences, _fastest_by_hand(saved, prompt, 32, 12))
    eager = _eager_by_hand(saved, prompt, 32, 12)
    print("full folder: hook", result.sequences[0, -12:].tolist(), "eager", eager[0, -12:].tolist())
    again = model.generate(prompt, max_new_tokens=12, do_sample=False, prefill_chunk_size=32)  # fused once: reused
    assert torch.equal(again, result.sequences)


def test_a_shipped_student_decodes_on_the_fastest_path(monkeypatch):
    monkeypatch.chdir(ROOT)
    folder = "checkpoints/testbed-4k-kvpop-cr88"
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).to("cuda")
    prompt = torch.randint(3, model.config.vocab_size, (1, 1500), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(1))
    result = model.generate(prompt, max_new_tokens=12, do_sample=False, custom_generate=folder,
                            trust_remote_code=True, return_dict_in_generate=True, prefill_chunk_size=512)
    assert _cache_of(result).kvpop_config.budget == 492
    fused = [n for n, m in model.named_modules() if isinstance(m, SharedStorageLinear)]
    assert fused and all(n.split(".")[-1] in ("gate_proj", "up_proj") for n in fused)  # q/k/v carry LoRA
    assert torch.equal(result.sequences, _fastest_by_hand(folder, prompt, 512, 12))
    eager = _eager_by_hand(folder, prompt, 512, 12)
    print("cr88: hook", result.sequences[0, -12:].tolist(), "eager", eager[0, -12:].tolist())
