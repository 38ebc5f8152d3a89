"""The ``custom_generate/generate.py`` hook of KVpop checkpoint folders (kvpop_hf/hub_generate.py), on CPU.

A folder written by ``KVpopTrainer.save_model`` carries the hook, and ``from_pretrained(dir,
trust_remote_code=True).generate(ids, max_new_tokens=N)`` decodes with the checkpoint's KVpopCache at its trained
budget, the same tokens as the explicit ``KVpopCache.from_pretrained`` + ``prefill_in_chunks`` + ``run_ahead_sample``
call, prompts longer than the budget (eviction) and than the prefill chunk. Without ``trust_remote_code``,
``generate`` is transformers' own. The shipped LoRA students carry the same hook, and since transformers reads the
hook of an adapter folder's base model, they generate through it with ``custom_generate=adapter_dir``, as a
scorer-only folder does over its base model.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.generation.utils import GenerationMixin

from helpers import distinct_ids, tiny_model
from kvpop_hf import KVpopCache, prefill_in_chunks, run_ahead_sample
from kvpop_hf.compat import with_cache
from kvpop_hf.hub_generate import HOOK_SOURCE, _fuse_once, _run_ahead_fits, generate
from kvpop_hf.trainer import KVpopTrainer, KVpopTrainingArguments

pytestmark = pytest.mark.tier("unit")

ROOT = Path(__file__).resolve().parents[1]
BUDGET = dict(sinks=2, window=5, topk=6)  # B = 13
STUDENTS = {"cr88": 492, "cr94": 246}


def _args(out, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=2, max_steps=2, learning_rate=1e-3,
                logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
                scorer="mlstm", scorer_kwargs='{"state_dim": 8}', **BUDGET)
    base.update(kw)
    return KVpopTrainingArguments(**base)


def _data():
    return [{"input_ids": r, "labels": r.clone()} for r in distinct_ids(8, 40)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("kvpop_full")
    trainer = KVpopTrainer(model=tiny_model("qwen3", attn="sdpa"), args=_args(out), train_dataset=_data())
    trainer.train()
    trainer.save_model(str(out))
    return out


def _cache_of(result):
    return getattr(result, "cache", None) or result.past_key_values


def _explicit(folder, prompt, chunk, max_new_tokens, **gen):
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="kvpop")
    cache = KVpopCache.from_pretrained(folder, model.config)
    prefill_in_chunks(model, cache, prompt, chunk)
    return model.generate(prompt, **with_cache(model, cache, max_new_tokens=max_new_tokens,
                                               custom_generate=run_ahead_sample, **gen))


def test_a_saved_folder_carries_the_hook(saved):
    assert (saved / "custom_generate" / "generate.py").read_text() == HOOK_SOURCE
    assert {"config.json", "model.safetensors", "kvpop_config.json"} <= {p.name for p in saved.iterdir()}


@pytest.mark.parametrize("chunk", [7, None])  # None: the default chunk (16384), one chunk here
def test_trust_remote_code_generates_with_the_checkpoints_cache(saved, chunk):
    model = AutoModelForCausalLM.from_pretrained(saved, trust_remote_code=True)
    assert isinstance(model.generate, functools.partial)
    prompt = distinct_ids(2, 30, seed=3)  # 30 tokens > B = 13: the cache evicts
    extra = {} if chunk is None else {"prefill_chunk_size": chunk}
    result = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0,
                            return_dict_in_generate=True, **extra)
    cache = _cache_of(result)
    assert isinstance(cache, KVpopCache)
    cfg = cache.kvpop_config
    assert (cfg.sinks, cfg.window, cfg.topk) == (BUDGET["sinks"], BUDGET["window"], BUDGET["topk"])
    assert all(layer.keys.shape[-2] == 13 for layer in cache.layers)  # the fixed budget, not the 37 tokens read
    assert model.config._attn_implementation == "kvpop"
    expect = _explicit(saved, prompt, chunk or 16384, 8, do_sample=False, pad_token_id=0)
    assert torch.equal(result.sequences, expect)
    # plain call: a tensor, as transformers' generate returns
    again = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0, **extra)
    assert torch.equal(again, expect)


def test_without_trust_remote_code_generate_is_transformers_own(saved):
    model = AutoModelForCausalLM.from_pretrained(saved)
    assert model.generate.__func__ is GenerationMixin.generate
    out = model.generate(distinct_ids(1, 20), max_new_tokens=3, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True)
    assert isinstance(_cache_of(out), DynamicCache) and model.config._attn_implementation == "sdpa"


def test_a_callers_cache_wins(saved):
    model = AutoModelForCausalLM.from_pretrained(saved, trust_remote_code=True)
    mine = DynamicCache()
    out = model.generate(distinct_ids(1, 20), max_new_tokens=3, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True, **with_cache(model, mine))
    assert _cache_of(out) is mine and mine.get_seq_length() == 22
    assert model.config._attn_implementation == "sdpa"  # passed through: nothing set on the model


def test_a_merged_lora_student_carries_the_hook(tmp_path):
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(tiny_model("qwen3", attn="sdpa"),
                               peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    trainer = KVpopTrainer(model=lora, args=_args(tmp_path / "run"), train_dataset=_data())
    trainer.train()
    trainer.save_merged_model(str(tmp_path / "merged"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", trust_remote_code=True)
    assert isinstance(model.generate, functools.partial)
    prompt = distinct_ids(1, 30, seed=5)
    out = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0, prefill_chunk_size=8)
    assert torch.equal(out, _explicit(tmp_path / "merged", prompt, 8, 6, do_sample=False, pad_token_id=0))


@pytest.mark.parametrize("name", sorted(STUDENTS))
def test_a_shipped_student_generates_through_its_hook(name, monkeypatch):
    monkeypatch.chdir(ROOT)  # the adapters name their base by a path relative to the repository root
    folder = f"checkpoints/testbed-4k-kvpop-{name}"
    assert (ROOT / folder / "custom_generate" / "generate.py").read_text() == HOOK_SOURCE
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    # transformers loaded the hook of the base model's folder (none): generate is its own until named
    assert model.generate.__func__ is GenerationMixin.generate
    prompt = torch.randint(3, model.config.vocab_size, (1, 600), generator=torch.Generator().manual_seed(1))
    result = model.generate(prompt, max_new_tokens=6, do_sample=False, custom_generate=folder, trust_remote_code=True,
                            return_dict_in_generate=True, prefill_chunk_size=256)
    cache = _cache_of(result)
    assert isinstance(cache, KVpopCache) and cache.kvpop_config.budget == STUDENTS[name] < 600
    assert torch.equal(result.sequences, _explicit(folder, prompt, 256, 6, do_sample=False))
    # the same through the library function, naming the folder
    direct = generate(prompt, model=model, kvpop_checkpoint=folder, max_new_tokens=6, do_sample=False,
                      prefill_chunk_size=256)
    assert torch.equal(direct, result.sequences)


def test_a_model_without_a_kvpop_checkpoint_names_the_fix(monkeypatch):
    monkeypatch.chdir(ROOT)
    teacher = AutoModelForCausalLM.from_pretrained("checkpoints/testbed-4k-kvpop-cr88")  # reports the teacher folder
    with pytest.raises(FileNotFoundError, match="custom_generate=ADAPTER_DIR"):
        generate(torch.tensor([[5, 6, 7]]), model=teacher, max_new_tokens=1)


def test_run_ahead_only_for_greedy_and_sampling():
    model = tiny_model("qwen3")
    assert _run_ahead_fits(model, {"do_sample": False})
    assert _run_ahead_fits(model, {"do_sample": True, "top_k": 5})
    assert not _run_ahead_fits(model, {"num_beams": 2})
    assert not _run_ahead_fits(model, {"return_dict_in_generate": True, "output_attentions": True})
    assert not _run_ahead_fits(model, {"assistant_model": tiny_model("qwen3")})


def test_projection_fusion_is_applied_once_and_survives_a_move():
    model = tiny_model("qwen3")
    ids = distinct_ids(1, 12)
    with torch.no_grad():
        before = model(ids).logits
    assert _fuse_once(model) and _fuse_once(model)
    attn = model.model.layers[0].self_attn
    stacked = attn.q_proj.stacked
    assert attn.k_proj.stacked is stacked and type(attn.q_proj).__name__ == "SharedStorageLinear"
    model.to(torch.float64)  # a move converts each module's buffer apart
    assert attn.k_proj.stacked is not attn.q_proj.stacked
    assert _fuse_once(model)
    assert attn.k_proj.stacked is attn.q_proj.stacked
    assert attn.k_proj.weight.data_ptr() == attn.q_proj.stacked[attn.k_proj.start:].data_ptr()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits.float(), before, atol=1e-5, rtol=0)


def test_the_model_card_names_both_calls():
    from kvpop_hf.config import KVpopConfig
    from kvpop_hf.trainer.model_card import render_model_card

    card = render_model_card(KVpopConfig(sinks=4, window=8, topk=4), model_name="m", repo="org/m", dataset="d",
                             steps=1, history=[])
    assert 'from_pretrained("org/m", trust_remote_code=True)' in card
    assert 'custom_generate="org/m", trust_remote_code=True' in card and "custom_generate/generate.py" in card


def test_a_scorer_only_folder_runs_its_hook_when_named(tmp_path):
    base = tmp_path / "base"
    tiny_model("qwen3", attn="sdpa").save_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, attn_implementation="sdpa")
    trainer = KVpopTrainer(model=model, args=_args(tmp_path / "scorer", train_backbone=False, scorer="mlp",
                                                   scorer_kwargs="{}"), train_dataset=_data())
    trainer.train()
    trainer.save_model(str(tmp_path / "scorer"))
    folder = tmp_path / "scorer"
    assert (folder / "custom_generate" / "generate.py").is_file() and not (folder / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(base, trust_remote_code=True)
    assert loaded.generate.__func__ is GenerationMixin.generate  # the base has no hook
    prompt = distinct_ids(1, 30, seed=7)
    result = loaded.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0, prefill_chunk_size=8,
                             custom_generate=str(folder), trust_remote_code=True, return_dict_in_generate=True)
    assert _cache_of(result).kvpop_config.topk == BUDGET["topk"]
    reference = AutoModelForCausalLM.from_pretrained(base, attn_implementation="kvpop")
    cache = KVpopCache.from_pretrained(folder, reference.config)
    prefill_in_chunks(reference, cache, prompt, 8)
    expect = reference.generate(prompt, **with_cache(reference, cache, max_new_tokens=6, do_sample=False,
                                                     pad_token_id=0, custom_generate=run_ahead_sample))
    assert torch.equal(result.sequences, expect)
