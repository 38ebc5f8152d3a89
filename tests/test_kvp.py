"""KVP (Learning to Evict from Key-Value Cache, ICML 2026): ranking maths against plain references, the
per-head AUC metric, the `kvp` policy, and training/train_kvp.py end to end (train, load, generate, resume)."""

import itertools
import json
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen3Config

from helpers import distinct_ids, tiny_model
from references import auc_cost_reference, future_attention_reference, pl_log_prob_reference
from kvpop_hf import KVpopCache
from kvpop_hf.compat import with_cache
from kvpop_hf.baselines.kvp.metric import auc_cost_per_head, eval_points, evicted_fraction, ordering
from kvpop_hf.baselines.kvp.ranking import gumbel_sort, pl_log_prob, rloo_advantages
from kvpop_hf.baselines.kvp.reward import auc_cost, future_attention, normalized_auc_cost, reward
from kvpop_hf.baselines.kvp.supervised import supervised_loss
from kvpop_hf.scorers import build_scorer
from kvpop_hf import policies

from kvpop_lab import train_kvp

pytestmark = pytest.mark.tier("scripts")


# -- maths ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [3, 4])
def test_pl_log_prob_matches_enumeration(n):
    scores = torch.randn(n, generator=torch.Generator().manual_seed(n))
    perms = torch.tensor(list(itertools.permutations(range(n))))
    fast = pl_log_prob(scores, perms)
    ref = torch.tensor([pl_log_prob_reference(scores, p) for p in perms])
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=0)
    assert math.isclose(float(fast.exp().sum()), 1.0, abs_tol=1e-5)  # a distribution over all n! orders


def test_gumbel_sort_samples_plackett_luce():
    scores = torch.tensor([1.0, 0.0, -0.5])
    perms = gumbel_sort(scores, 40000, torch.Generator().manual_seed(0))
    for p in itertools.permutations(range(3)):
        freq = (perms == torch.tensor(p)).all(-1).float().mean()
        assert abs(float(freq) - math.exp(float(pl_log_prob(scores, torch.tensor(p))))) < 0.01


def test_auc_cost_is_rank_weighted_sum_and_oracle_normalises_to_one():
    u = torch.rand(6, generator=torch.Generator().manual_seed(1))
    costs = []
    for p in itertools.permutations(range(6)):
        p = torch.tensor(p)
        assert math.isclose(float(auc_cost(u, p)), auc_cost_reference(u, p), rel_tol=1e-5)
        costs.append(float(normalized_auc_cost(u, p)))
    oracle = torch.argsort(u, descending=True)
    assert math.isclose(float(normalized_auc_cost(u, oracle)), 1.0, rel_tol=1e-6)
    assert math.isclose(min(costs), 1.0, rel_tol=1e-6) and float(reward(u, oracle)) == pytest.approx(-1.0)


def test_rloo_baseline_is_mean_of_the_others():
    r = torch.tensor([-1.2, -1.5, -1.1, -1.8])
    adv = rloo_advantages(r)
    expect = torch.stack([r[i] - torch.cat([r[:i], r[i + 1:]]).mean() for i in range(4)])
    torch.testing.assert_close(adv, expect)
    assert float(adv[0]) == pytest.approx(-1.2 + 4.4 / 3)
    with pytest.raises(ValueError):
        rloo_advantages(r[:1])


def test_future_attention_matches_loops():
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(4, 23, 8, generator=g), torch.randn(2, 23, 8, generator=g)
    for n in (1, 10, 22):
        torch.testing.assert_close(future_attention(q, k, n, 0.4, chunk=5), future_attention_reference(q, k, n, 0.4),
                                   atol=1e-5, rtol=1e-5)


def test_supervised_losses_prefer_the_oracle_scores():
    u = torch.rand(2, 12, generator=torch.Generator().manual_seed(3)) + 0.01
    good = torch.log(u / u.mean(-1, keepdim=True))
    for kind in ("listnet", "pointwise"):
        assert (supervised_loss(good, u, kind) < supervised_loss(good.flip(-1), u, kind)).all()
    with pytest.raises(ValueError):
        supervised_loss(good, u, "nope")


def test_metric_oracle_priority_scores_one_and_protection_ranks_first():
    assert ordering(torch.tensor([0.1, 5.0, 3.0, 2.0, 1.0]), protect=(1, 1)).tolist()[:2] == [0, 4]

    class Oracle:  # priorities = the future attention of the trace at the evaluated length
        stateful = False

        def __init__(self, u):
            self.u = u

        def score(self, layer_idx, keys, values, positions):
            return self.u[layer_idx][None, :, : keys.shape[2]]

    g = torch.Generator().manual_seed(4)
    trace = {"q": torch.randn(2, 4, 30, 8, generator=g), "k": torch.randn(2, 2, 30, 8, generator=g),
             "v": torch.randn(2, 2, 30, 8, generator=g), "scale": 0.35}
    points = eval_points([trace], [0.5])
    cost = auc_cost_per_head(Oracle(points[0][2]), [trace], points, window=4)
    torch.testing.assert_close(cost, torch.ones(2, 2))
    assert (auc_cost_per_head(build_scorer("knorm", 2, 2, 8), [trace], points, window=4) >= 1).all()

    u = points[0][2][0, 0]
    best, perm = torch.argsort(u, descending=True), torch.randperm(u.shape[0], generator=g)
    assert float(evicted_fraction(u, perm, 0)) == pytest.approx(1.0) and float(evicted_fraction(u, perm, 15)) == pytest.approx(0.0, abs=1e-6)
    assert float(evicted_fraction(u, best, 5)) <= float(evicted_fraction(u, perm, 5))
    tail = u.sort(descending=True).values[5:].sum() / u.sum()
    assert float(evicted_fraction(u, best, 5)) == pytest.approx(float(tail))


def test_kvp_scorer_is_static_and_policy_checks_objective(tmp_path):
    model = tiny_model("qwen3")
    cache = KVpopCache(model.config, sinks=2, window=4, topk=6, scorer="kvp",
                       scorer_kwargs={"trained_with": "supervised", "max_positions": 16})
    k = torch.randn(1, 2, 20, 16)
    pos = torch.arange(20).view(1, 1, 20).expand(1, 2, 20)
    whole = cache.scorer.score(0, k, k, pos)
    one = torch.cat([cache.scorer.score(0, k[:, :, t:t + 1], k[:, :, t:t + 1], pos[:, :, t:t + 1])
                     for t in range(20)], 2)
    torch.testing.assert_close(whole, one)  # a token's score is its own (a static priority)
    cache.save_pretrained(tmp_path / "kvp_supervised")
    assert policies.scan_checkpoints_dir(tmp_path) == {("kvp_supervised", None): str(tmp_path / "kvp_supervised")}
    policies.load_prototype("kvp_supervised", str(tmp_path / "kvp_supervised"))
    with pytest.raises(ValueError, match="trained_with"):
        policies.load_prototype("kvp", str(tmp_path / "kvp_supervised"))
    with pytest.raises(ValueError, match="trained_with"):
        build_scorer("kvp", 1, 1, 4, trained_with="bandit")


# -- the CLI end to end ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from kvpop_lab.testbed import build_tokenizer

    root = tmp_path_factory.mktemp("kvp")
    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    return root


def _argv(root, out, *extra):
    return ["--model", str(root / "model"), "--out", str(root / out), "--traces-file", str(root / "traces.pt"),
            "--families", "reasoning,vt", "--length", "300", "--train-traces", "2", "--heldout-traces", "1",
            "--samples", "4", "--min-context", "16", "--sinks", "2", "--window", "8", "--topk", "20",
            "--fractions", "0.5", "--budgets", "40", "--save-every", "1", "--no-progress", *extra]


@pytest.mark.parametrize("objective", ["rl", "supervised"])
def test_cli_trains_a_loadable_checkpoint_that_generates(tiny_dir, objective):
    assert train_kvp.main(_argv(tiny_dir, objective, "--objective", objective, "--steps", "3")) == 0
    out = tiny_dir / objective
    assert (out / "auc_cost.csv").is_file() and "knorm" in (out / "auc_cost.md").read_text()
    assert "--objective" in json.loads((out / "meta.json").read_text())["command"]
    assert "evicted share" in (out / "auc_cost.md").read_text() and (out / "evicted_share.csv").is_file()
    assert len((out / "train_log.csv").read_text().splitlines()) == 4
    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "model", attn_implementation="kvpop").eval()
    cache = KVpopCache.from_pretrained(out, model.config)
    assert cache.kvpop_config.scorer == "kvp" and cache.scorer.trained_with == objective
    name = "kvp" if objective == "rl" else "kvp_supervised"
    policies.load_prototype(name, str(out))
    ids = distinct_ids(1, 40) + 10
    seq = model.generate(ids, **with_cache(model, cache), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert seq.shape == (1, 48)
    assert int(cache.layers[0].get_seq_length()) == 47


def test_cli_resume_continues_exactly(tiny_dir):
    assert train_kvp.main(_argv(tiny_dir, "straight", "--steps", "4")) == 0
    assert train_kvp.main(_argv(tiny_dir, "resumed", "--steps", "2")) == 0
    assert train_kvp.main(_argv(tiny_dir, "resumed", "--steps", "4", "--resume")) == 0
    a = load_file(tiny_dir / "straight" / "kvpop_scorer.safetensors")
    b = load_file(tiny_dir / "resumed" / "kvpop_scorer.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=0, rtol=0)
    assert (tiny_dir / "resumed" / "train_log.csv").read_text().count("\n") == 5


def test_cli_knobs_shape_the_traces_and_bad_knobs_fail_first(tiny_dir, tmp_path):
    from kvpop_lab.testbed.tasks import make_problem

    argv = _argv(tiny_dir, "knobs", "--steps", "1", "--traces-file", str(tmp_path / "t.pt"),
                 "--knob", "reasoning.n_facts=3", "reasoning.steps=2")
    assert train_kvp.main(argv) == 0
    data = torch.load(tmp_path / "t.pt", weights_only=True)
    assert data["meta"]["knobs"] == {"reasoning": {"n_facts": 3, "steps": 2}}
    trace = next(t for t in data["train"] if t["family"] == "reasoning")
    plain = make_problem("reasoning", length=300, seed=trace["seed"])
    knobbed = make_problem("reasoning", length=300, seed=trace["seed"], n_facts=3, steps=2)
    assert knobbed.prompt != plain.prompt
    # the same file asked for without knobs is refused (its traces were made with them)
    with pytest.raises(ValueError, match="holds traces of"):
        train_kvp.main(_argv(tiny_dir, "knobs2", "--steps", "1", "--traces-file", str(tmp_path / "t.pt")))
    # a knob of a family that is not traced, or a malformed one, fails before anything is written
    for bad, msg in ((["--knob", "cwe.n_words=5"], "does not trace"), (["--knob", "reasoning_steps"], "FAMILY.KEY")):
        with pytest.raises(ValueError, match=msg):
            train_kvp.main(_argv(tiny_dir, "bad", *bad))
        assert not (tiny_dir / "bad").exists()


def test_cli_bad_device_fails_first(tiny_dir):
    for bad, msg in (("gpu0", "not a torch device"), ("cuda", "lacks")):
        if bad == "cuda" and torch.cuda.is_available():
            continue
        with pytest.raises(ValueError, match=msg):
            train_kvp.main(_argv(tiny_dir, "bad_device", "--device", bad))
        assert not (tiny_dir / "bad_device").exists()


def test_cli_budgets_take_token_counts_and_a_ratio_fails_first(tiny_dir):
    for bad, msg in (("0.88", "0.88 is a compression ratio: give it as --compression 0.88"),
                     ("40,1e2", "Bad --budgets value '1e2'")):
        with pytest.raises(ValueError, match=msg):
            train_kvp.main(_argv(tiny_dir, "bad_budgets", "--budgets", bad))
        assert not (tiny_dir / "bad_budgets").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cli_on_cuda_saves_a_cpu_checkpoint_and_resumes_exactly(tiny_dir, tmp_path):
    argv = lambda out, *x: _argv(tiny_dir, out, "--device", "cuda", "--traces-file", str(tmp_path / "t.pt"), *x)  # noqa: E731
    assert train_kvp.main(argv("cuda_straight", "--steps", "4")) == 0
    assert train_kvp.main(argv("cuda_resumed", "--steps", "2")) == 0
    assert train_kvp.main(argv("cuda_resumed", "--steps", "4", "--resume")) == 0
    a = load_file(tiny_dir / "cuda_straight" / "kvpop_scorer.safetensors")
    b = load_file(tiny_dir / "cuda_resumed" / "kvpop_scorer.safetensors")
    for name in a:
        assert a[name].device.type == "cpu"
        torch.testing.assert_close(a[name], b[name])
    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "model", attn_implementation="kvpop").eval()
    cache = KVpopCache.from_pretrained(tiny_dir / "cuda_straight", model.config)
    assert cache.scorer.trained_with == "rl"
