"""CPU smoke test of training/pretrain_teacher.py and kvpop_lab.testbed.dense_eval (a few seconds)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.tier("scripts")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("teacher")
    cmd = [sys.executable, os.path.join(ROOT, "training", "pretrain_teacher.py"), "--out", str(out),
           "--steps", "3", "--seq-len", "256:320", "--batch-size", "2", "--lr", "1e-3", "--seed", "0",
           "--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
           "--warmup", "2", "--eval-n", "1", "--workers", "1", "--knob", "reasoning.steps=3",
           "--lookup-weight", "0.3", "--probe-every", "3", "--probe-n", "2",
           "--device", "cpu"]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out


def test_checkpoint_files_and_manifest(teacher_dir):
    for f in ("config.json", "model.safetensors", "tokenizer.json", "manifest.json"):
        assert (teacher_dir / f).exists(), f
    man = json.loads((teacher_dir / "manifest.json").read_text())
    assert man["steps"] == 3 and man["seed"] == 0
    assert "pretrain_teacher.py" in man["command"] and "git_commit" in man
    assert set(man["eval"]["em"]) >= {"reasoning", "vt", "niah_multikey", "cwe", "fwe"}
    assert man["data"]["knobs"] == {"reasoning": {"steps": 3}}
    assert man["data"]["families"]["lookup"] == 0.3 and "lookup" in man["eval"]["em"]
    # the probe ran at step 3: fact-lookup and token accuracy on fixed reasoning problems
    assert [p["step"] for p in man["probe_curve"]] == [3]
    assert 0.0 <= man["probe_curve"][0]["lookup_acc"] <= 1.0 and 0.0 <= man["probe_curve"][0]["token_acc"] <= 1.0
    assert os.path.getsize(teacher_dir / "model.safetensors") <= 15 * 2 ** 20


def _run_pretrain(args, timeout=120):
    cmd = [sys.executable, os.path.join(ROOT, "training", "pretrain_teacher.py"), *args]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_init_from_continues_the_saved_weights(teacher_dir, tmp_path):
    from safetensors.torch import load_file
    out = tmp_path / "cont"
    r = _run_pretrain(["--out", str(out), "--init-from", str(teacher_dir), "--steps", "1", "--seq-len", "256:256",
                       "--batch-size", "1", "--lr", "1e-9", "--warmup", "1", "--eval-n", "1", "--workers", "0",
                       "--device", "cpu"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "initialised from" in r.stdout
    before, after = load_file(teacher_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys()
    for k in before:  # one step at lr 1e-9: the weights are the saved ones (up to bf16 rounding)
        assert before[k].shape == after[k].shape
        assert (before[k].float() - after[k].float()).abs().max() < 1e-2, k
    assert json.loads((out / "manifest.json").read_text())["args"]["init_from"] == str(teacher_dir)


def test_init_from_rejects_architecture_flags_and_missing_folder(teacher_dir, tmp_path):
    r = _run_pretrain(["--out", str(tmp_path / "a"), "--init-from", str(teacher_dir), "--hidden", "128",
                       "--steps", "1", "--device", "cpu"])
    assert r.returncode != 0 and "drop --hidden" in r.stderr
    r = _run_pretrain(["--out", str(tmp_path / "b"), "--init-from", str(tmp_path / "nowhere"), "--steps", "1",
                       "--device", "cpu"])
    assert r.returncode != 0 and "no config.json" in r.stderr


def test_checkpoint_loads_and_dense_eval_runs(teacher_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvpop_lab.testbed import FAMILIES, make_problem
    from kvpop_lab.testbed.dense_eval import exact_match

    model = AutoModelForCausalLM.from_pretrained(str(teacher_dir), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(teacher_dir))
    assert model.config.model_type == "qwen3"
    assert tok.eos_token == "<eos>" and tok.padding_side == "left"
    probs = [make_problem(f, length=200, seed=i, **({"steps": 3} if f == "reasoning" else {}))
             for f in FAMILIES for i in range(2)]
    calls = []

    def factory():
        calls.append(1)
        return None  # dense; exercises the cache_factory path

    res = exact_match(model, tok, probs, max_new_tokens=6, batch_size=4, cache_factory=factory, progress=False)
    assert set(res["em"]) == set(FAMILIES) | {"all"}
    assert all(0.0 <= v <= 1.0 for v in res["em"].values())
    assert len(res["outputs"]) == len(probs) and len(calls) == 3
    assert [o["family"] for o in res["outputs"]] == [p.family for p in probs]


def test_dense_eval_scores_a_perfect_oracle():
    """A fake model that emits the reference target -> EM 1.0 on every family (left padding, eos stop)."""
    import torch

    from kvpop_lab.testbed import FAMILIES, build_tokenizer, make_problem
    from kvpop_lab.testbed.dense_eval import exact_match
    from kvpop_lab.testbed.tasks import encode_plain

    tok = build_tokenizer()
    probs = [make_problem(f, length=150 + 40 * i, seed=i, **({"steps": 2} if f == "reasoning" else {}))
             for f in FAMILIES for i in range(2)]
    by_prompt = {tuple(tok(p.prompt)["input_ids"]): encode_plain(tok, p.target) + [tok.eos_token_id]
                 for p in probs}

    class Oracle(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def generate(self, input_ids, attention_mask, max_new_tokens, **kw):
            rows = []
            for ids, m in zip(input_ids, attention_mask):
                tgt = by_prompt[tuple(ids[m.bool()].tolist())]
                tgt = (tgt + [tok.pad_token_id] * max_new_tokens)[:max_new_tokens]
                rows.append(torch.cat([ids, torch.tensor(tgt)]))
            return torch.stack(rows)

    res = exact_match(Oracle(), tok, probs, batch_size=3, progress=False)
    assert all(v == 1.0 for v in res["em"].values()), res["em"]


def test_batch_length_covers_both_ends_of_the_range():
    import random
    from kvpop_lab.pretrain_teacher import batch_length
    rng = random.Random(0)
    seen = [batch_length(rng, 256, 1024, 128) for _ in range(2000)]
    assert set(seen) == {256, 384, 512, 640, 768, 896, 1024}
    assert min(seen.count(v) for v in set(seen)) > 200  # uniform: ~286 each
    assert {batch_length(rng, 300, 1000, 128) for _ in range(500)} == {384, 512, 640, 768, 896}
    assert batch_length(rng, 300, 330, 128) == 300  # no multiple inside: the low end itself
    assert {batch_length(rng, 5, 7, 1) for _ in range(100)} == {5, 6, 7}


def test_mixture_weights_named_family_and_even_split_of_the_rest():
    from kvpop_lab.pretrain_teacher import mixture_weights
    w = mixture_weights(0.5, 0.15, [("vt", 0.3)])
    assert w["vt"] == 0.3 and w["lookup"] == 0.15 and w["reasoning"] == 0.5
    assert w["niah_multikey"] == w["cwe"] == w["fwe"] == pytest.approx(0.05 / 3)
    assert sum(w.values()) == pytest.approx(1.0)
    # no named family: the old even split over the four other families
    w = mixture_weights(0.6, 0.3, [])
    assert all(w[f] == pytest.approx(0.025) for f in ("vt", "niah_multikey", "cwe", "fwe"))
    for named, msg in [([("reasoning", 0.1)], "unknown family"), ([("vt", 0.1), ("vt", 0.2)], "twice"),
                       ([("vt", 0.6)], "more than 1"), ([("vt", -0.1)], ">= 0")]:
        with pytest.raises(ValueError, match=msg):
            mixture_weights(0.5, 0.0, named)


def test_family_weight_flag_is_refused_before_any_work(tmp_path):
    script = os.path.join(ROOT, "training", "pretrain_teacher.py")
    for flag, msg in [("vt", "FAMILY=WEIGHT"), ("vt=0.9", "more than 1"), ("bogus=0.1", "unknown family")]:
        r = subprocess.run([sys.executable, script, "--out", str(tmp_path / "t"), "--family-weight", flag,
                            "--reasoning-weight", "0.5", "--device", "cpu"], capture_output=True, text=True,
                           timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
        assert r.returncode != 0 and msg in r.stderr, r.stderr[-2000:]
        assert not (tmp_path / "t").exists()


def test_mixture_weights_over_chosen_families():
    from kvpop_lab.pretrain_teacher import mixture_weights
    fams = ("reasoning", "vt", "niah_multivalue", "niah_multiquery")
    w = mixture_weights(0.4, 0.1, [("vt", 0.2)], fams)
    assert set(w) == set(fams) | {"lookup"} and w["vt"] == 0.2
    assert w["niah_multivalue"] == w["niah_multiquery"] == pytest.approx(0.15)
    assert sum(w.values()) == pytest.approx(1.0)
    w = mixture_weights(None, 0.0, [], ("cwe", "niah_multiquery"))  # no reasoning: none in the mixture
    assert w == pytest.approx({"cwe": 0.5, "niah_multiquery": 0.5})
    assert mixture_weights(None, 0.0, [])["reasoning"] == 0.5  # the default families keep reasoning at 0.5
    for args, msg in [((0.5, 0.0, [], ("vt", "cwe")), "reasoning is not among --families"),
                      ((None, 0.0, [], ("vt", "lookup")), "unknown family lookup"),
                      ((None, 0.0, [], ("vt", "bogus")), "unknown family bogus"),
                      ((None, 0.0, [], ("vt", "vt")), "vt given twice"),
                      ((None, 0.0, [], ()), "names no family"),
                      ((None, 0.0, [("cwe", 0.1)], ("vt", "fwe")), "unknown family 'cwe'")]:
        with pytest.raises(ValueError, match=msg):
            mixture_weights(*args)


def test_families_and_size_flags_are_refused_before_any_work(tmp_path):
    for flags, msg in [(["--families", "vt,bogus"], "unknown family bogus"),
                       (["--families", "vt,cwe", "--reasoning-weight", "0.3"], "not among --families"),
                       (["--heads", "6", "--kv-heads", "4"], "multiple of --kv-heads"),
                       (["--layers", "0"], "--layers must be >= 1"),
                       (["--max-weights-mib", "0"], "--max-weights-mib must be > 0")]:
        r = _run_pretrain(["--out", str(tmp_path / "t"), "--device", "cpu", *flags])
        assert r.returncode != 0 and msg in r.stderr, (flags, r.stderr[-2000:])
        assert not (tmp_path / "t").exists()


def test_many_family_run_trains_and_evaluates_the_chosen_families(tmp_path):
    out = tmp_path / "many"
    fams = "reasoning,vt,niah_multikey,niah_multivalue,niah_multiquery,cwe,fwe"
    r = _run_pretrain(["--out", str(out), "--families", fams, "--reasoning-weight", "0.3", "--lookup-weight", "0.1",
                       "--steps", "2", "--seq-len", "256:256", "--batch-size", "2", "--warmup", "1", "--eval-n", "1",
                       "--workers", "0", "--hidden", "64", "--layers", "1", "--heads", "4", "--kv-heads", "2",
                       "--head-dim", "16", "--knob", "reasoning.steps=3", "--device", "cpu"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    man = json.loads((out / "manifest.json").read_text())
    assert set(man["data"]["families"]) == set(fams.split(",")) | {"lookup"}
    assert man["data"]["families"]["niah_multiquery"] == pytest.approx(0.1)
    assert set(man["eval"]["em"]) == set(fams.split(",")) | {"lookup", "all"}
