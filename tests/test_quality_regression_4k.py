"""Quality regression at 4096 tokens on the committed 4k checkpoints (CPU, ~4 min; marked ``slow``).

At 1024 tokens exact match does not separate the policies (``test_quality_regression.py``); at 4096 tokens it
does. Eight reasoning problems of 4096 tokens with the testbed's 4k knobs (10 facts, 4 rules; seeds 2**48 + i,
the first eight of ``results/testbed_4k``), 88% compression with a 32-token window: B = 492 = 4 sinks + 32
window + 456 slots, the budget the committed ``checkpoints/scorers_4k/*_cr88`` scorers were trained for.
Measured on CPU, float32 (the same problems on the GPU, ``results/testbed_4k/eval_learned`` and
``retrofit_mlstm/eval_learned``, give the same per-problem answers):

| policy                         | problems answered exactly (of 8) |
|--------------------------------|----------------------------------|
| dense teacher (first 4)        | 4 of 4                           |
| kvpop_mlp (scorer only)        | 3  (problems 0, 5, 6)            |
| kvpop (mLSTM, scorer only)     | 2  (problems 1, 5)               |
| streaming                      | 0                                |

The test fails if a learned scorer loses more than one of its answers, if it no longer beats StreamingLLM (the
best heuristic at this budget on all 40 problems: EM 0.05; K-Norm and Random 0), or if the teacher stops
solving the problems. Teacher-forced token and fact-lookup accuracy of KVpop_mlp on problems 0-3, measured on
CPU (torch 2.13, transformers 5.24): 0.990 / 0.800, StreamingLLM 0.874 / 0.100.

The distilled student ``checkpoints/students_4k/kvpop_distill_cr88`` (the mLSTM scorer with ``token_readout``,
64-token window, LoRA-distilled model; ``results/testbed_4k/token_readout``) on the same eight problems, with its
scorer at B = 492 (88%, 424 slots) and at B = 246 (94%, the same scorer with 178 slots), measured on CPU with this
module's ``answered`` (float32, torch 2.13, transformers 5.24, 2026-12-01; StreamingLLM at 94% likewise); the
student's answers are the same per problem as in the GPU run (where it answers 37 and 30 of 40); StreamingLLM's at
88% are not (the GPU run answers none of these eight: a greedy trace flips on float noise when it is borderline):

| policy (window 64)             | 88%: answered (of 8)     | 94%: answered (of 8) |
|--------------------------------|--------------------------|----------------------|
| distilled KVpop student        | 7  (all but problem 2)   | 3  (problems 1, 3, 4) |
| streaming (on the teacher)     | 2  (problems 5, 7)       | 0                    |

It fails if the student loses more than one answer at either budget or no longer keeps at least three more
answers than StreamingLLM at 88%.

What CI runs (each problem is a 4096-token prefill plus a greedy trace on CPU, so the cost is the number of
(policy, problem) runs; the per-problem answers above fix what each subset must give):

* the teacher (dense) on problems 0 and 1: both answered (of the 4 of 4 measured);
* the scorers at 88% on problems 0, 1, 5, 6 (``SCORER_PROBLEMS``): the problems either learned scorer answers;
  measured KVpop_mlp 3 of 4, KVpop 2 of 4, StreamingLLM 0 of 4. Bar: each learned scorer keeps all but one of
  its answers (>= 2 and >= 1 of 4) and answers more than StreamingLLM. The other four problems are answered by
  none of the three policies, so they could only show a gain, which no bar checks;
* teacher-forced accuracy of KVpop_mlp on problems 0-3 as measured: token accuracy >= 0.97 and fact-lookup
  accuracy >= 0.65 (StreamingLLM's, 0.874 / 0.100, is measured above and not re-run: the lookup bar is 0.55
  above it);
* the student on problems 0, 1, 3, 4, 6 (``STUDENT_PROBLEMS``): measured 5 of 5 at 88%, 3 of 5 at 94% (problems
  1, 3, 4), StreamingLLM at 88% 0 of 5. Bar: the student loses at most one answer at either budget (>= 4 of 5,
  >= 2 of 5) and keeps at least three more answers than StreamingLLM at 88%. Problems 2, 5 and 7 are left out:
  on 2 the student fails at both budgets, on 5 and 7 StreamingLLM's answer flips between CPU and GPU.
"""

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TEACHER = ROOT / "checkpoints" / "teacher_4k"
SCORERS = ROOT / "checkpoints" / "scorers_4k"
LENGTH, SINKS, WINDOW, B, N = 4096, 4, 32, 492, 8
KNOBS = {"n_facts": 10, "steps": 4}
TEACHER_PROBLEMS = (0, 1)
SCORER_PROBLEMS = (0, 1, 5, 6)
MEASURED = {"kvpop_mlp": 3, "kvpop": 2}  # exact answers of SCORER_PROBLEMS (the same as of all N)
MARGIN = 1
MEASURED_TF = {"tok": 0.990, "lookup": 0.800}  # KVpop_mlp, teacher-forced, problems 0-3
MARGIN_TF = {"tok": 0.02, "lookup": 0.15}

STUDENT = ROOT / "checkpoints" / "students_4k" / "kvpop_distill_cr88"
STUDENT_WINDOW, STUDENT_TOPK = 64, {0.88: 424, 0.94: 178}
STUDENT_PROBLEMS = (0, 1, 3, 4, 6)
MEASURED_STUDENT = {0.88: 5, 0.94: 3}  # exact answers of STUDENT_PROBLEMS (7 and 3 of all N)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (TEACHER / "model.safetensors").is_file(), reason="4k teacher not committed")]


@pytest.fixture(scope="module")
def setup():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import kvpop_hf  # noqa: F401  (registers the "kvpop" attention)
    from kvpop_hf.testbed import make_problem

    model = AutoModelForCausalLM.from_pretrained(TEACHER, dtype=torch.float32, attn_implementation="kvpop").eval()
    tok = AutoTokenizer.from_pretrained(TEACHER)
    problems = [make_problem("reasoning", length=LENGTH, seed=2 ** 48 + i, **KNOBS) for i in range(N)]
    return model, tok, problems


def answered(model, tok, problems, cache_factory=None) -> int:
    from kvpop_hf.testbed.dense_eval import exact_match

    out = exact_match(model, tok, problems, batch_size=len(problems), cache_factory=cache_factory, progress=False)
    return sum(o["correct"] for o in out["outputs"])


def test_teacher_solves_the_4k_problems(setup):
    model, tok, problems = setup
    assert answered(model, tok, [problems[i] for i in TEACHER_PROBLEMS]) == len(TEACHER_PROBLEMS)


def test_learned_scorers_keep_answers_at_88_percent(setup):
    from kvpop_hf import KVpopCache

    model, tok, problems = setup
    problems = [problems[i] for i in SCORER_PROBLEMS]
    got = {}
    for name in MEASURED:
        factory = lambda n=name: KVpopCache.from_pretrained(SCORERS / f"{n}_cr88", model.config)  # noqa: E731
        assert factory().budget == B
        got[name] = answered(model, tok, problems, factory)
    got["streaming"] = answered(model, tok, problems, lambda: KVpopCache(
        model.config, sinks=SINKS, window=WINDOW, topk=B - SINKS - WINDOW, scorer="streaming"))
    for name, measured in MEASURED.items():
        assert got[name] >= measured - MARGIN, got
        assert got[name] > got["streaming"], got


def test_kvpop_mlp_token_and_lookup_accuracy(setup):
    from kvpop_hf import KVpopCache
    from kvpop_hf.testbed.evaluate import token_accuracy

    model, tok, problems = setup
    r = token_accuracy(model, tok, problems[:4], progress=False,
                       cache_factory=lambda: KVpopCache.from_pretrained(SCORERS / "kvpop_mlp_cr88", model.config))
    got = {"tok": r["acc"]["all"], "lookup": r["lookup_acc"]["reasoning"]}
    for metric, measured in MEASURED_TF.items():
        assert got[metric] >= measured - MARGIN_TF[metric], got


def test_distilled_kvpop_student_keeps_answers_at_88_and_94_percent(setup):
    from kvpop_hf import KVpopCache
    from kvpop_hf.testbed.models import load_model

    teacher, tok, problems = setup
    problems = [problems[i] for i in STUDENT_PROBLEMS]
    student = load_model(str(STUDENT), torch.float32, torch.device("cpu"))  # stored as a weight delta of the teacher
    got = {}
    for cr, k in STUDENT_TOPK.items():
        factory = lambda k=k: KVpopCache.from_pretrained(STUDENT, student.config, topk=k)  # noqa: E731
        assert factory().budget == SINKS + STUDENT_WINDOW + k and factory().kvpop_config.window == STUDENT_WINDOW
        got[cr] = answered(student, tok, problems, factory)
    got["streaming_88"] = answered(teacher, tok, problems, lambda: KVpopCache(
        teacher.config, sinks=SINKS, window=STUDENT_WINDOW, topk=STUDENT_TOPK[0.88], scorer="streaming"))
    for cr, measured in MEASURED_STUDENT.items():
        assert got[cr] >= measured - MARGIN, got
    assert got[0.88] >= got["streaming_88"] + 3, got
