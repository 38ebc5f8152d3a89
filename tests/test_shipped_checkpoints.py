"""The shipped testbed checkpoints load as their model cards show. The teacher is a plain model directory; each
student is a PEFT LoRA adapter over it plus a KVpop scorer: ``AutoModelForCausalLM.from_pretrained(adapter_dir)``
(the adapter's base path is relative to the repository root) and ``PeftModel.from_pretrained(teacher,
adapter_dir)`` give the same model, ``KVpopCache.from_pretrained(adapter_dir)`` its cache, and it generates. The
adapter changes only the attention projections."""

import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TEACHER = ROOT / "checkpoints" / "testbed-4k-teacher"
STUDENTS = {"cr88": (ROOT / "checkpoints" / "testbed-4k-kvpop-cr88", 492),
            "cr94": (ROOT / "checkpoints" / "testbed-4k-kvpop-cr94", 246)}  # B = 4 sinks + 64 window + slots
KNOBS = {"n_facts": 10, "steps": 4}  # the problems they were trained on (the generator's defaults differ)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")

pytestmark = [pytest.mark.tier("quality")]


@pytest.mark.parametrize("name", sorted(STUDENTS))
def test_adapter_names_the_teacher_and_targets_attention_only(name):
    from safetensors import safe_open

    folder, _ = STUDENTS[name]
    cfg = json.loads((folder / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and (ROOT / cfg["base_model_name_or_path"]) == TEACHER
    assert json.loads((folder / "kvpop_config.json").read_text())["base_model"] == cfg["base_model_name_or_path"]
    assert set(cfg["target_modules"]) <= set(ATTENTION) and not cfg["modules_to_save"]
    with safe_open(folder / "adapter_model.safetensors", "pt") as f:
        keys = list(f.keys())
    assert keys and all(".self_attn." in k and k.split(".self_attn.")[1].split(".")[0] in ATTENTION
                        and ".lora_" in k for k in keys), keys
    assert not (folder / "config.json").exists() and not (folder / "model.safetensors").exists()  # no full copy


def test_adapter_loads_both_ways_and_generates(monkeypatch):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import kvpop_hf  # noqa: F401  (registers the "kvpop" attention)
    from kvpop_hf import KVpopCache
    from kvpop_hf.compat import with_cache
    from kvpop_lab.testbed import make_problem

    folder, budget = STUDENTS["cr88"]
    monkeypatch.chdir(ROOT)  # the adapter names its base as checkpoints/testbed-4k-teacher
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="kvpop", dtype=torch.float32).eval()
    teacher = AutoModelForCausalLM.from_pretrained(TEACHER, attn_implementation="kvpop", dtype=torch.float32)
    explicit = PeftModel.from_pretrained(teacher, folder).eval()
    tok = AutoTokenizer.from_pretrained(TEACHER)
    cache = KVpopCache.from_pretrained(folder, model.config)
    assert cache.budget == budget

    problem = make_problem("reasoning", length=1024, seed=2 ** 48, **KNOBS)
    ids = tok(problem.prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        a, b = model(ids[:, :256]).logits, explicit(ids[:, :256]).logits
    torch.testing.assert_close(a, b)

    n_new = 12
    with torch.no_grad():
        out = model.generate(ids, **with_cache(model, cache, max_new_tokens=n_new, do_sample=False))
    assert out.shape == (1, ids.shape[1] + n_new)
    # B = 492 < the prompt: the cache evicted, and still the first trace tokens are the reference's
    want = tok(problem.target, add_special_tokens=False).input_ids[:n_new]
    assert out[0, ids.shape[1]:].tolist() == want

    # merged into the teacher, the adapter changed the attention projections only; every other tensor is equal
    base = load_file(TEACHER / "model.safetensors")
    assert all(v.dtype == torch.bfloat16 for v in base.values())  # the teacher is stored in bf16
    state = explicit.merge_and_unload().state_dict()
    changed = {k for k, v in base.items() if not torch.equal(state[k], v.float())}
    assert changed and all(".self_attn." in k and k.endswith("_proj.weight") for k in changed), changed
