"""The shipped distilled student loads as a plain model directory: ``AutoModelForCausalLM.from_pretrained`` for
the weights and ``KVpopCache.from_pretrained`` for its cache, then generates (the usage its model card shows)."""

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
STUDENT = ROOT / "checkpoints" / "students_4k" / "kvpop_distill_cr88"
TEACHER = ROOT / "checkpoints" / "teacher_4k"
KNOBS = {"n_facts": 10, "steps": 4}  # the problems it was trained on (the generator's defaults differ)

pytestmark = pytest.mark.skipif(not (STUDENT / "model.safetensors").is_file(), reason="student not committed")


def test_student_loads_and_generates_with_its_cache():
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import kvpop_hf  # noqa: F401  (registers the "kvpop" attention)
    from kvpop_hf import KVpopCache
    from kvpop_hf.compat import with_cache
    from kvpop_hf.testbed import make_problem

    model = AutoModelForCausalLM.from_pretrained(STUDENT, attn_implementation="kvpop").eval()
    assert next(model.parameters()).dtype == torch.bfloat16  # stored in its config's dtype, as the teacher
    tok = AutoTokenizer.from_pretrained(STUDENT)
    cache = KVpopCache.from_pretrained(STUDENT, model.config)
    assert cache.budget == 492  # 4 sinks + 64 window + 424 slots

    # the merged LoRA changed the attention projections only; every other tensor is the teacher's
    teacher = load_file(TEACHER / "model.safetensors")
    state = model.state_dict()
    changed = {k for k, v in teacher.items() if not torch.equal(state[k], v)}
    assert changed and all(".self_attn." in k and k.endswith("_proj.weight") for k in changed)

    problem = make_problem("reasoning", length=1024, seed=2 ** 48, **KNOBS)
    ids = tok(problem.prompt, return_tensors="pt").input_ids
    n_new = 12
    with torch.no_grad():
        out = model.generate(ids, **with_cache(model, cache, max_new_tokens=n_new, do_sample=False))
    assert out.shape == (1, ids.shape[1] + n_new)
    # B = 492 < the prompt: the cache evicted, and still the first trace tokens are the reference's
    want = tok(problem.target, add_special_tokens=False).input_ids[:n_new]
    assert out[0, ids.shape[1]:].tolist() == want
