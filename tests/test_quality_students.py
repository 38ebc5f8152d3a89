"""Quality of the shipped testbed students (marker ``quality``; CPU, several minutes): each LoRA student, loaded
from its adapter folder as its model card shows (``AutoModelForCausalLM.from_pretrained(adapter_dir)`` from the
repository root, ``KVpopCache.from_pretrained(adapter_dir)``), answers the first eight of the 80 fresh 4096-token
reasoning problems of its card (seeds 2**48 + 5000 + i, 10 facts, 4 rules) as measured on CPU, losing at most one.

Measured on CPU (float32, torch 2.13, transformers 5.25, 2026-12-05, commit f5f08c4) with

    kvpop-eval --model checkpoints/testbed-4k-teacher --length 4096 --seed-base 281474976715656 --n 8 \
        --batch-size 8 --families reasoning --sinks 4 --window 64 --knob reasoning.n_facts=10 \
        --knob reasoning.steps=4 --device cpu --compression 0.88,0.94 --policies kvpop_distill \
        --scorer-checkpoint kvpop_distill@cr88=checkpoints/testbed-4k-kvpop-cr88 \
        --scorer-checkpoint kvpop_distill@cr94=checkpoints/testbed-4k-kvpop-cr94 --out OUT

per-problem answers (1 = exact match; problem i has seed 2**48 + 5000 + i):

| student (budget)     | 0 | 1 | 2 | 3 | 4 | 5 | 6 | 7 | answered |
|----------------------|---|---|---|---|---|---|---|---|----------|
| cr88 (88%, B = 492)  | 1 | 1 | 1 | 0 | 1 | 1 | 1 | 1 | 7 of 8   |
| cr94 (94%, B = 246)  | 1 | 1 | 1 | 1 | 1 | 1 | 1 | 1 | 8 of 8   |

the same per problem as the GPU run on these eight, and the same generated text with the adapters and scorers in
fp32 (as trained) and in bf16 (as shipped).

On all 80 problems on the GPU (``checkpoints/testbed-4k-kvpop-cr*/README.md``) the students answer 76/80 (cr88)
and 65/80 (cr94); the dense teacher answers all 80.
"""

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TEACHER = ROOT / "checkpoints" / "testbed-4k-teacher"
LENGTH, N, SEED_BASE = 4096, 8, 2 ** 48 + 5000
KNOBS = {"n_facts": 10, "steps": 4}
STUDENTS = {  # folder, budget B, measured answers of problems 0..N-1
    "cr88": (ROOT / "checkpoints" / "testbed-4k-kvpop-cr88", 492, (1, 1, 1, 0, 1, 1, 1, 1)),
    "cr94": (ROOT / "checkpoints" / "testbed-4k-kvpop-cr94", 246, (1, 1, 1, 1, 1, 1, 1, 1)),
}
MARGIN = 1

pytestmark = [pytest.mark.quality,
              pytest.mark.skipif(not (TEACHER / "model.safetensors").is_file(), reason="testbed teacher not committed")]


@pytest.mark.parametrize("name", sorted(STUDENTS))
def test_student_keeps_its_measured_answers(name, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import kvpop_hf  # noqa: F401  (registers the "kvpop" attention)
    from kvpop_hf import KVpopCache
    from kvpop_lab.testbed import make_problem
    from kvpop_lab.testbed.dense_eval import exact_match

    folder, budget, measured = STUDENTS[name]
    monkeypatch.chdir(ROOT)  # the adapter names its base model relative to the repository root
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="kvpop", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(TEACHER)
    assert KVpopCache.from_pretrained(folder, model.config).budget == budget
    problems = [make_problem("reasoning", length=LENGTH, seed=SEED_BASE + i, **KNOBS) for i in range(N)]
    out = exact_match(model, tok, problems, batch_size=N, progress=False,
                      cache_factory=lambda: KVpopCache.from_pretrained(folder, model.config))
    got = [int(o["correct"]) for o in out["outputs"]]
    lost = [i for i in range(N) if measured[i] and not got[i]]
    assert sum(got) >= sum(measured) - MARGIN and len(lost) <= MARGIN, (got, measured)
