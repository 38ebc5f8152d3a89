"""Quality of the shipped testbed students (marker ``quality``; CPU, about two minutes each): each LoRA student,
loaded from its adapter folder as its model card shows (``AutoModelForCausalLM.from_pretrained(adapter_dir)`` from
the repository root, ``KVpopCache.from_pretrained(adapter_dir)``), answers the 80 fresh 4096-token reasoning
problems of its card (seeds 2**48 + 5000 + i, 10 facts, 4 rules) as its card states.

The cards state the GPU run (76/80 for cr88, 65/80 for cr94). On CPU (float32, torch 2.13.0, transformers 5.25.0,
prompts fed in 512-token chunks, batch 16; commit 1ef6a4f, 2026-12-05) the same students answer 75/80 and 65/80,
per problem as in ``STUDENTS`` below. Chunked prefill keeps the same entries as one chunk (the eviction contract);
on the first eight problems the generated ids were identical with and without chunking. The test allows two
problems of difference from both the card and the CPU measurement (float32 on another CPU can flip a close answer).
"""

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TEACHER = ROOT / "checkpoints" / "testbed-4k-teacher"
LENGTH, N, SEED_BASE, CHUNK = 4096, 80, 2 ** 48 + 5000, 512
KNOBS = {"n_facts": 10, "steps": 4}
STUDENTS = {  # folder, budget B, answers stated by the model card (of 80), CPU answers of problems 0..79
    "cr88": (ROOT / "checkpoints" / "testbed-4k-kvpop-cr88", 492, 76,
             "11101111111111111111111011111011111111110111111111111111111111111101111111111111"),
    "cr94": (ROOT / "checkpoints" / "testbed-4k-kvpop-cr94", 246, 65,
             "11111111101111110111001101100011111111110111111111111101101011110111111111110110"),
}
MARGIN = 2

pytestmark = [pytest.mark.tier("quality")]


@pytest.mark.parametrize("name", sorted(STUDENTS))
def test_student_keeps_its_measured_answers(name, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import kvpop_hf  # noqa: F401  (registers the "kvpop" attention)
    from kvpop_hf import KVpopCache
    from kvpop_lab.testbed import make_problem
    from kvpop_lab.testbed.dense_eval import exact_match

    folder, budget, card, cpu = STUDENTS[name]
    measured = [int(c) for c in cpu]
    monkeypatch.chdir(ROOT)  # the adapter names its base model relative to the repository root
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="kvpop", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(TEACHER)
    assert KVpopCache.from_pretrained(folder, model.config).budget == budget
    problems = [make_problem("reasoning", length=LENGTH, seed=SEED_BASE + i, **KNOBS) for i in range(N)]
    out = exact_match(model, tok, problems, batch_size=16, progress=False, prefill_chunk=CHUNK,
                      cache_factory=lambda: KVpopCache.from_pretrained(folder, model.config))
    got = [int(o["correct"]) for o in out["outputs"]]
    lost = [i for i in range(N) if measured[i] and not got[i]]
    assert abs(sum(got) - card) <= MARGIN, f"{sum(got)}/80 answered, the model card states {card}/80"
    assert len(lost) <= MARGIN, f"problems {lost} were answered when measured and are not now"
