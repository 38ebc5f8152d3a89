"""Quality regression on the committed testbed checkpoints (CPU).

The GPU run in results/eval_testbed_gpu (table + recall_per_layer.csv, 2 reasoning problems of 2048
tokens, B = 246 = 88% compression) measured the recall of the future-attention oracle's top-k:
kvpop 0.662, kvpop_mlp 0.742, streaming 0.084, knorm 0.210, random 0.242. Exact match cannot serve
as the regression signal on this testbed: the committed teacher's dense exact match is ~0 at 2048
tokens (see the README), so it would pass whatever the scorers do. Recall is what the scorers were
trained for and separates them from every heuristic; this test fails if it drops by more than the
margin or stops beating the heuristics.
"""

import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TEACHER = ROOT / "checkpoints" / "teacher"
SCORERS = ROOT / "checkpoints" / "scorers"
MEASURED = {"kvpop": 0.483, "kvpop_mlp": 0.562}
MARGIN = 0.05


@pytest.mark.skipif(not (TEACHER / "model.safetensors").is_file(), reason="testbed teacher not committed")
def test_oracle_recall_of_committed_scorers_at_88_percent():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvpop_hf import KVpopCache
    from kvpop_hf.testbed import make_problem
    from kvpop_hf.testbed.analysis import recall_rows

    model = AutoModelForCausalLM.from_pretrained(TEACHER, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(TEACHER)
    length, B, window = 1024, 123, 32
    problems = [make_problem("reasoning", length=length, seed=2 ** 48 + i) for i in range(2)]
    budget = types.SimpleNamespace(B=B, cr=0.88)
    scored = [("kvpop", budget, KVpopCache.from_pretrained(SCORERS / "kvpop_cr88", model.config)),
              ("kvpop_mlp", budget, KVpopCache.from_pretrained(SCORERS / "kvpop_mlp_cr88", model.config))]
    for name in ("streaming", "knorm", "random"):
        scored.append((name, budget, KVpopCache(model.config, sinks=4, window=window, topk=B - 4 - window,
                                                 scorer=name)))
    assert all(c.budget == B for _, _, c in scored)
    rows = recall_rows(model, tok, problems, scored, progress=False)
    recall = {}
    for name in {r["policy"] for r in rows}:
        vals = [r["recall"] for r in rows if r["policy"] == name]
        recall[name] = sum(vals) / len(vals)
    for name, measured in MEASURED.items():
        assert recall[name] >= measured - MARGIN, recall
    best_heuristic = max(recall[n] for n in ("streaming", "knorm", "random"))
    assert min(recall["kvpop"], recall["kvpop_mlp"]) > best_heuristic + 0.2, recall
