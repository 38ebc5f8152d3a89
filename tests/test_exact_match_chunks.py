"""kvpop_lab.testbed.dense_eval.exact_match(prefill_chunk=N): prompts in chunks for the caches whose kept sets do
not depend on the chunking (the same text as one chunk), one chunk for the others."""

from pathlib import Path

import pytest
import torch

from kvpop_hf.policies import bind_factory
from kvpop_lab.testbed import make_problem
from kvpop_lab.testbed.dense_eval import chunking_keeps_sets, exact_match

TEACHER = Path(__file__).resolve().parents[1] / "checkpoints" / "testbed-4k-teacher"
pytestmark = [pytest.mark.tier("unit")]


@pytest.fixture(scope="module")
def teacher():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import kvpop_hf  # noqa: F401  (registers the "kvpop" attention)

    model = AutoModelForCausalLM.from_pretrained(TEACHER, attn_implementation="kvpop", dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(TEACHER)


def test_which_caches_take_chunks(teacher):
    cfg = teacher[0].config
    keeps = {name: chunking_keeps_sets(bind_factory(name)(cfg, 4, 16, 40))
             for name in ("streaming", "knorm", "keydiff", "tova", "snapkv", "h2o")}
    assert keeps == {"streaming": True, "knorm": True, "keydiff": True, "tova": False, "snapkv": False, "h2o": False}
    assert not chunking_keeps_sets(None) and not chunking_keeps_sets(object())


@pytest.mark.parametrize("policy", ["knorm", "tova"])
def test_chunked_prompts_give_the_one_chunk_text(teacher, policy, monkeypatch):
    model, tok = teacher
    problems = [make_problem("reasoning", length=512, seed=7 + i) for i in range(2)]
    factory = lambda: bind_factory(policy)(model.config, 4, 16, 40)  # noqa: E731  (B = 60 of ~500 prompt tokens)
    one = exact_match(model, tok, problems, batch_size=2, cache_factory=factory, progress=False)
    seen = []
    generate = model.generate
    monkeypatch.setattr(model, "generate", lambda **kw: seen.append(kw.get("prefill_chunk_size")) or generate(**kw))
    chunked = exact_match(model, tok, problems, batch_size=2, cache_factory=factory, progress=False, prefill_chunk=128)
    assert seen == ([128] if policy == "knorm" else [None])  # TOVA's kept set depends on the chunking: one chunk
    assert [o["generated"] for o in chunked["outputs"]] == [o["generated"] for o in one["outputs"]]


def test_a_negative_chunk_is_refused(teacher):
    model, tok = teacher
    with pytest.raises(ValueError, match="prefill_chunk must be >= 0"):
        exact_match(model, tok, [make_problem("vt", length=256, seed=0)], prefill_chunk=-1, progress=False)
