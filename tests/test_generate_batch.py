"""generate_batch (continuous batching over the rows of one KVpopCache) against solo ``generate`` runs, each with a
fresh cache of the same budget: greedy and sampled tokens, forks, stop conditions, hybrid models, bad input."""

import random

import pytest
import torch

from helpers import VOCAB as QWEN_VOCAB, tiny_model
from hybrid_helpers import VOCAB as HYBRID_VOCAB, hybrid_model
from kvpop_hf import KVpopCache
from kvpop_hf.batch import BatchRequest, generate_batch, generate_batch_stream
from kvpop_hf.compat import with_cache
from kvpop_hf import rows as row_ops

pytestmark = pytest.mark.tier("unit")

KW = dict(sinks=2, window=6, topk=8)  # B = 16: prompts up to 40 tokens and outputs up to 30 evict


def _model(name, dtype=torch.float32):
    if name == "qwen3":
        model, vocab = tiny_model("qwen3"), QWEN_VOCAB
    else:
        model, vocab = hybrid_model(name), HYBRID_VOCAB
    model.generation_config.eos_token_id = None  # random weights: stop on length unless a test sets an EOS
    # float64: a batch of R rows runs other matrix-product kernels than a batch of one (float32 results differ in
    # the last bits), and such a difference can flip the eviction of two keys of near-equal priority; in float64
    # that takes a tie within ~1e-16, so the comparison checks the rows' bookkeeping, not the kernels' rounding
    return model.to(dtype), vocab


def _cache(model, scorer="knorm"):
    return KVpopCache(model.config, scorer=scorer, **KW)


def _solo(model, prompt, max_new, scorer="knorm", seed=None, **gen):
    """The reference: ``generate`` of this prompt alone with a fresh cache (sampling under torch.manual_seed)."""
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), **with_cache(model, _cache(model, scorer)), max_new_tokens=max_new,
                             pad_token_id=0, return_dict_in_generate=True, output_logits=True, **gen)
    return out.sequences[0, len(prompt):].tolist(), [x[0] for x in out.logits]


def _requests(vocab, count=24, seed=0, longest=40, **kw):
    g = torch.Generator().manual_seed(seed)
    reqs = []
    for i in range(count):
        n = int(torch.randint(1, longest + 1, (), generator=g))
        m = int(torch.randint(1, 31, (), generator=g))
        reqs.append(BatchRequest(torch.randint(3, vocab, (n,), generator=g).tolist(), request_id=f"r{i}",
                                 max_new_tokens=m, **kw))
    reqs[0].input_ids = reqs[0].input_ids[:1]  # a one-token prompt
    reqs[1].max_new_tokens = 30  # prompt + output past the budget
    random.Random(seed).shuffle(reqs)  # arrival order unrelated to lengths
    return reqs


@pytest.mark.parametrize("name,scorer,dtype", [("qwen3", "knorm", torch.float64), ("qwen3", "mlstm", torch.float32),
                                               ("gemma3", "knorm", torch.float64), ("gpt_oss", "knorm", torch.float32)])
def test_greedy_equals_solo_generate(name, scorer, dtype):
    model, vocab = _model(name, dtype)
    reqs = _requests(vocab)
    assert any(len(r.input_ids) > 16 for r in reqs) and any(len(r.input_ids) + r.max_new_tokens > 40 for r in reqs)
    res = generate_batch(model, reqs, cache=_cache(model, scorer), max_rows=4, progress_bar=False)
    assert list(res) == [r.request_id for r in reqs]
    for r in reqs:
        ref, _ = _solo(model, r.input_ids, r.max_new_tokens, scorer, min_new_tokens=r.max_new_tokens)
        assert res[r.request_id].generated_tokens == ref, r.request_id
        assert res[r.request_id].finish_reason == "length"


def test_greedy_equals_solo_on_linear_attention_layers():
    model, vocab = _model("qwen3_next")
    reqs = _requests(vocab, count=8, longest=24)
    res = generate_batch(model, reqs, cache=_cache(model), max_rows=3, progress_bar=False)
    for r in reqs:
        assert res[r.request_id].generated_tokens == _solo(model, r.input_ids, r.max_new_tokens)[0], r.request_id


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_sampled_requests_equal_their_solo_runs_under_their_seeds(name):
    model, vocab = _model(name)
    reqs = _requests(vocab, count=10, seed=1)
    settings = [dict(do_sample=True), dict(do_sample=True, temperature=0.7, top_k=20),
                dict(do_sample=True, top_p=0.9), dict(do_sample=False)]
    for i, r in enumerate(reqs):
        for k, v in settings[i % len(settings)].items():
            setattr(r, k, v)
        r.seed = 100 + i
    res = generate_batch(model, reqs, cache=_cache(model), max_rows=4, progress_bar=False)
    for i, r in enumerate(reqs):
        gen = settings[i % len(settings)]
        ref, _ = _solo(model, r.input_ids, r.max_new_tokens, seed=r.seed, **gen)
        assert res[r.request_id].generated_tokens == ref, (r.request_id, gen)
        assert res[r.request_id].seed == r.seed


@pytest.mark.parametrize("name", ["qwen3", "gpt_oss"])
def test_fork_equals_separate_prefills(name):
    """n samples of one prompt: one prefill copied into n rows gives what n prefills give (tokens and logits), and
    sample j is the solo run under seed + j."""
    model, vocab = _model(name)
    prompt = torch.randint(3, vocab, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    n, seed, new = 5, 7, 12
    forked = generate_batch(model, [BatchRequest(prompt, seed=seed, num_return_sequences=n)], cache=_cache(model),
                            max_rows=3, progress_bar=False, do_sample=True, max_new_tokens=new, output_logits=True)
    assert list(forked) == ["req_0"] + [f"req_0__child#{j}" for j in range(1, n)]
    separate = generate_batch(model, [BatchRequest(prompt, seed=seed + j) for j in range(n)], cache=_cache(model),
                              max_rows=3, progress_bar=False, do_sample=True, max_new_tokens=new, output_logits=True)
    for j, (a, b) in enumerate(zip(forked.values(), separate.values())):
        assert a.generated_tokens == b.generated_tokens
        for x, y in zip(a.logits, b.logits):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
        ref, ref_logits = _solo(model, prompt, new, seed=seed + j, do_sample=True)
        assert a.generated_tokens == ref
        for x, y in zip(a.logits, ref_logits):
            torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)
    assert len({tuple(o.generated_tokens) for o in forked.values()}) > 1  # the seeds differ


def test_num_return_sequences_in_the_generation_config():
    from transformers import GenerationConfig

    model, vocab = _model("qwen3")
    cfg = GenerationConfig(do_sample=True, num_return_sequences=3, max_new_tokens=4)
    res = generate_batch(model, [[5, 6, 7], [8, 9]], cfg, cache=_cache(model), max_rows=2, progress_bar=False, seed=0)
    assert list(res) == ["req_0", "req_0__child#1", "req_0__child#2", "req_1", "req_1__child#1", "req_1__child#2"]
    assert [o.seed - res["req_0"].seed for o in list(res.values())[:3]] == [0, 1, 2]


def test_eos_and_stop_strings():
    model, vocab = _model("qwen3")
    prompt = list(range(20, 35))
    ref, _ = _solo(model, prompt, 12)
    eos = ref[4]
    stop_at = ref.index(eos)
    res = generate_batch(model, [BatchRequest(prompt, eos_token_id=eos), prompt], cache=_cache(model), max_rows=2,
                         progress_bar=False, max_new_tokens=12)
    assert res["req_0"].generated_tokens == ref[:stop_at + 1] and res["req_0"].finish_reason == "eos"
    assert res["req_1"].generated_tokens == ref and res["req_1"].finish_reason == "length"

    class Tok:  # token t decodes to "<t>"
        def decode(self, ids):
            return "".join(f"<{t}>" for t in ids)

    stop = f"<{ref[2]}><{ref[3]}>"
    res = generate_batch(model, [BatchRequest(prompt, stop_strings=stop)], cache=_cache(model), max_rows=1,
                         progress_bar=False, max_new_tokens=12, tokenizer=Tok())
    assert res["req_0"].generated_tokens == ref[:4] and res["req_0"].finish_reason == "stop_string"


def test_stream_yields_each_sequence_as_it_finishes_and_every_token_on_request():
    model, vocab = _model("qwen3")
    reqs = [BatchRequest([3, 4, 5], max_new_tokens=m) for m in (9, 2, 5)]
    finished = [rid for rid, _, out in generate_batch_stream(model, reqs, cache=_cache(model), max_rows=3)]
    assert finished == ["req_1", "req_2", "req_0"]
    seen = {}
    for rid, tokens, out in generate_batch_stream(model, reqs, cache=_cache(model), max_rows=2, every_token=True):
        seen.setdefault(rid, []).extend(tokens)
        if out is not None:
            assert out.generated_tokens == seen[rid]
    assert [len(seen[f"req_{i}"]) for i in range(3)] == [9, 2, 5]


def test_row_copy_and_reset():
    model, vocab = _model("gemma3")
    src = _cache(model)
    from kvpop_hf.batch import _prefill

    _prefill(model, src, list(range(3, 30)), 8, torch.device("cpu"))
    dst = _cache(model)
    row_ops.setup_rows(dst, src, 3)
    row_ops.copy_rows(dst, src, [0, 2])
    for a, b in zip(dst.kvpop_layers(), src.kvpop_layers()):
        for name in ("keys", "pos", "prio", "seen"):
            assert torch.equal(getattr(a, name)[0], getattr(b, name)[0])
            assert torch.equal(getattr(a, name)[2], getattr(b, name)[0])
    row_ops.reset_rows(dst, 0)
    layer = dst.kvpop_layers()[0]
    assert int(layer.seen[0]) == 0 and bool((layer.pos[0] == -1).all()) and int(layer.seen[2]) == 27


def test_bad_input_is_refused_before_any_work():
    from transformers import DynamicCache, GenerationConfig

    model, vocab = _model("qwen3")
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match="empty prompt"):
        generate_batch(model, [[1, 2], []], cache=_cache(model), max_rows=2)
    with pytest.raises(ValueError, match="max_rows"):
        generate_batch(model, [[1, 2]], cache=_cache(model), max_rows=0)
    used = _cache(model)
    generate_batch(model, [[1, 2]], cache=used, max_rows=2, max_new_tokens=1, progress_bar=False)
    calls.clear()
    with pytest.raises(ValueError, match="batch size 2 but max_rows=4"):
        generate_batch(model, [[1, 2]], cache=used, max_rows=4)
    with pytest.raises(ValueError, match="re-scores"):
        generate_batch(model, [[1, 2]], cache=KVpopCache(model.config, scorer="tova", **KW), max_rows=2)
    with pytest.raises(ValueError, match="num_beams"):
        generate_batch(model, [[1, 2]], GenerationConfig(num_beams=2), cache=_cache(model), max_rows=2)
    with pytest.raises(ValueError, match="tokenizer"):
        generate_batch(model, [BatchRequest([1, 2], stop_strings="x")], cache=_cache(model), max_rows=2)
    with pytest.raises(ValueError, match="KVpopCache"):
        generate_batch(model, [[1, 2]], cache=DynamicCache(), max_rows=2)
    assert generate_batch(model, [], cache=_cache(model), max_rows=2) == {}
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="'kvpop' attention"):
        generate_batch(model, [[1, 2]], cache=_cache(model), max_rows=2)
    assert calls == []
