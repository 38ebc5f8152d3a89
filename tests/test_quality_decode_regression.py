"""Quality through the decode path: the shipped students with their learned caches (B = 492 and 246 entries per
KV head), the last 256 tokens of a 1024-token reasoning trace of the 4k testbed (10 facts, 4 rules) fed as
single-token decode steps (the fixed-shape step that ``generate`` uses) after a prefill of the rest, against the
same problem fed in one forward (the chunk path). The eviction contract makes both keep the same entries, so their
greedy next-token predictions agree; a wrong decode-step eviction (e.g. keeping the loser) or an immediate instead
of a delayed read breaks that agreement and drops the accuracy."""

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TEACHER = ROOT / "checkpoints" / "testbed-4k-teacher"
STUDENTS = {tag: ROOT / "checkpoints" / f"testbed-4k-kvpop-{tag}" for tag in ("cr88", "cr94")}
TAIL = 256
# greedy accuracy on the trace tokens of this tail through decode steps, measured with the shipped students
# (torch 2.13 CPU, 2026-12-05): 105/105 for both; the floors allow two tokens less.
FLOOR = {"cr88": 102.5 / 105, "cr94": 102.5 / 105}
pytestmark = [pytest.mark.tier("quality")]


@pytest.fixture(scope="module")
def problem():
    from transformers import AutoTokenizer

    from kvpop_lab.testbed import make_problem
    from kvpop_lab.testbed.evaluate import training_example

    tok = AutoTokenizer.from_pretrained(TEACHER)
    p = make_problem("reasoning", length=1024, seed=2 ** 48, n_facts=10, steps=4)
    ex = training_example(p, tok, mode="trace")
    return torch.tensor([ex["input_ids"]]), torch.tensor(ex["labels"])


def student(folder):
    """The LoRA student: its adapter over the teacher, given explicitly (peft), merged."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import kvpop_hf  # noqa: F401  (registers the "kvpop" attention)

    base = AutoModelForCausalLM.from_pretrained(TEACHER, dtype=torch.float32, attn_implementation="kvpop")
    return PeftModel.from_pretrained(base, folder).merge_and_unload().eval()


def decode_and_chunk(name, ids, labels):
    """(agreement of the decode steps with the chunk path, decode-step accuracy) on the tail's trace tokens."""
    from kvpop_hf import KVpopCache
    from kvpop_hf.compat import with_cache

    model = student(STUDENTS[name])
    T = ids.shape[1]
    make = lambda: KVpopCache.from_pretrained(STUDENTS[name], model.config)  # noqa: E731
    with torch.no_grad():
        whole = model(ids, **with_cache(model, make())).logits[0, T - TAIL - 1:-1]
        cache = make()
        steps = [model(ids[:, :T - TAIL], **with_cache(model, cache)).logits[0, -1:]]
        steps += [model(ids[:, t:t + 1], **with_cache(model, cache)).logits[0] for t in range(T - TAIL, T - 1)]
        steps = torch.cat(steps)
    assert T - TAIL > cache.budget  # the prefill alone overflows the budget: every decode step evicts
    gold = labels[T - TAIL:]
    target = gold != -100
    assert int(target.sum()) >= 100  # the tail is mostly trace: what the scorers must keep the facts for
    agree = (steps.argmax(-1) == whole.argmax(-1))[target].float().mean().item()
    acc = (steps.argmax(-1) == gold)[target].float().mean().item()
    return agree, acc, int(target.sum())


@pytest.mark.parametrize("name", sorted(STUDENTS))
def test_decode_steps_keep_what_the_chunk_path_keeps(problem, name):
    agree, acc, _ = decode_and_chunk(name, *problem)
    assert agree >= 0.99, agree
    assert acc >= FLOOR[name], acc
