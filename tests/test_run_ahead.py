"""run_ahead_sample (custom_generate) against the stock generate loop: same sequences, scores and streamed tokens;
after a stop on EOS the cache has read exactly one more token, which a later generate call continues from."""

import traceback

import pytest
import torch
from transformers import DynamicCache, StaticCache
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.generation.streamers import BaseStreamer

from helpers import distinct_ids, left_padded, tiny_model
from kvpop_hf import KVpopCache
from kvpop_hf.compat import with_cache
from kvpop_hf.run_ahead import run_ahead_sample

pytestmark = pytest.mark.tier("unit")

KW = dict(sinks=2, window=6, topk=8)  # B = 16: the prompts and generations below evict


class Recorder(BaseStreamer):
    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.clone().view(-1))

    def end(self):
        self.ended = True


def _cache(model, kind):
    return KVpopCache(model.config, scorer=kind, **KW) if kind != "dynamic" else DynamicCache(config=model.config)


def _batch():
    rows = [distinct_ids(1, n, seed=n)[0] for n in (30, 21, 26)]
    ids, mask, _ = left_padded(rows)
    return ids, mask


@pytest.mark.parametrize("kind", ["knorm", "mlstm", "dynamic"])
def test_greedy_matches_stock_loop(kind):
    model = tiny_model("qwen3")
    ids, mask = _batch()
    gen = dict(max_new_tokens=25, min_new_tokens=25, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
               output_scores=True, output_logits=True)
    stock_cache, ahead_cache = _cache(model, kind), _cache(model, kind)
    stock = model.generate(ids, attention_mask=mask, **with_cache(model, stock_cache), **gen)
    ahead = model.generate(ids, attention_mask=mask, **with_cache(model, ahead_cache), **gen,
                           custom_generate=run_ahead_sample)
    assert torch.equal(stock.sequences, ahead.sequences)
    assert len(ahead.scores) == len(stock.scores) == 25 and len(ahead.logits) == 25
    for a, b in zip(stock.scores + stock.logits, ahead.scores + ahead.logits):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    # stopped at max_length, known on the host: no extra step, both caches read the same tokens
    assert int(stock_cache.get_seq_length()) == int(ahead_cache.get_seq_length()) == stock.sequences.shape[1] - 1
    for ls, la in zip(stock_cache.layers, ahead_cache.layers):
        torch.testing.assert_close(ls.keys, la.keys, atol=0, rtol=0)


def _eos_after(model, kind, ids, steps):
    """A token the stock greedy loop emits at new-token index ``steps`` or later and never before."""
    out = model.generate(ids, **with_cache(model, _cache(model, kind)), max_new_tokens=40, do_sample=False,
                         pad_token_id=0)[0, ids.shape[1]:]
    for i in range(steps, len(out)):
        if out[i] not in out[:i]:
            return int(out[i]), i
    pytest.skip("no fresh token in the greedy continuation")


@pytest.mark.parametrize("kind", ["knorm", "mlstm"])
def test_eos_stop_one_step_late_and_continuation(kind):
    model = tiny_model("qwen3")
    ids = distinct_ids(1, 28, seed=3)
    eos, at = _eos_after(model, kind, ids, 6)
    gen = dict(max_new_tokens=40, do_sample=False, pad_token_id=0, eos_token_id=eos)
    stock_cache, ahead_cache = _cache(model, kind), _cache(model, kind)
    stock_rec, ahead_rec = Recorder(), Recorder()
    stock = model.generate(ids, **with_cache(model, stock_cache), **gen, streamer=stock_rec)
    ahead = model.generate(ids, **with_cache(model, ahead_cache), **gen, stream_to=ahead_rec,
                           custom_generate=run_ahead_sample)
    assert torch.equal(stock, ahead) and stock.shape[1] == ids.shape[1] + at + 1 and stock[0, -1] == eos
    assert torch.equal(torch.cat(stock_rec.puts), torch.cat(ahead_rec.puts)) and ahead_rec.ended
    # the stop was seen one step late: the cache has read the EOS token too, and says so
    assert int(ahead_cache.get_seq_length()) == ahead.shape[1] == int(stock_cache.get_seq_length()) + 1
    # a follow-up turn continues from there: same tokens, same logits as after the stock loop
    turn = torch.cat([stock, distinct_ids(1, 9, seed=11)], 1)
    more = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    after_stock = model.generate(turn, **with_cache(model, stock_cache), **more)
    after_ahead = model.generate(turn, **with_cache(model, ahead_cache), **more, custom_generate=run_ahead_sample)
    assert torch.equal(after_stock.sequences, after_ahead.sequences)
    for a, b in zip(after_stock.logits, after_ahead.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_batch_rows_finishing_at_different_steps():
    model = tiny_model("qwen3")
    ids, mask = _batch()
    free = model.generate(ids, attention_mask=mask, **with_cache(model, _cache(model, "knorm")), max_new_tokens=30,
                          do_sample=False, pad_token_id=0)
    eos = int(free[0, ids.shape[1] + 4])  # row 0 stops early; the others stop when they meet it, or at the limit
    gen = dict(max_new_tokens=30, do_sample=False, pad_token_id=0, eos_token_id=eos)
    stock = model.generate(ids, attention_mask=mask, **with_cache(model, _cache(model, "knorm")), **gen)
    ahead = model.generate(ids, attention_mask=mask, **with_cache(model, _cache(model, "knorm")), **gen,
                           custom_generate=run_ahead_sample)
    assert torch.equal(stock, ahead)
    assert (stock[0, ids.shape[1] + 5:] == 0).all()  # padded after its EOS in both


def test_sampling_matches_stock_loop_with_the_same_seed():
    model = tiny_model("qwen3")
    ids, mask = _batch()
    gen = dict(max_new_tokens=20, do_sample=True, top_k=20, temperature=0.8, pad_token_id=0)
    torch.manual_seed(7)
    stock = model.generate(ids, attention_mask=mask, **with_cache(model, _cache(model, "mlstm")), **gen)
    torch.manual_seed(7)
    ahead = model.generate(ids, attention_mask=mask, **with_cache(model, _cache(model, "mlstm")), **gen,
                           custom_generate=run_ahead_sample)
    assert torch.equal(stock, ahead)


def test_unsupported_outputs_refused_before_any_work():
    model = tiny_model("qwen3")
    cache, rec = _cache(model, "knorm"), Recorder()
    with pytest.raises(ValueError, match="output_attentions / output_hidden_states.*without custom_generate"):
        model.generate(distinct_ids(1, 10), **with_cache(model, cache), max_new_tokens=3, pad_token_id=0,
                       return_dict_in_generate=True, output_hidden_states=True, custom_generate=run_ahead_sample,
                       stream_to=rec)
    assert cache.get_seq_length() == 0 and rec.puts == []


class _HostReads(TorchDispatchMode):
    """Counts ops that read a tensor's value on the host (a device synchronisation on CUDA) or copy Python data
    to a tensor (a synchronising copy from pageable memory on CUDA) inside the decoding loop, outside the model's
    forward and the prefill."""

    OPS = ("aten._local_scalar_dense.default", "aten.lift_fresh.default", "aten.nonzero.default")

    def __init__(self):
        super().__init__()
        self.found = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in self.OPS:
            frames = [(f.filename, f.name) for f in traceback.extract_stack()]
            in_loop = any(name in ("run_ahead_sample", "_sample") for _, name in frames)
            excluded = any(name in ("_prefill", "_read", "_call_impl") or "kvpop_hf/layer.py" in file
                           for file, name in frames)
            if in_loop and not excluded:
                self.found.append((str(func), [f"{file.rsplit('/', 1)[-1]}:{name}" for file, name in frames[-8:]]))
        return func(*args, **(kwargs or {}))


def test_decode_steps_read_nothing_from_the_device():
    """Between the prefill and the end, the loop itself (input preparation, logits processors, stopping criteria,
    the flags) never reads a device value: what lets the host run one step ahead on CUDA. The stock loop's own
    per-step read is found by the same probe."""
    model = tiny_model("qwen3")
    ids = distinct_ids(1, 30)
    gen = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=3)
    for loop, expect_reads in (("stock", True), ("run_ahead", False)):
        probe = _HostReads()
        extra = {"custom_generate": run_ahead_sample} if loop == "run_ahead" else {}
        with probe:
            model.generate(ids, **with_cache(model, _cache(model, "mlstm")), **gen, **extra)
        assert bool(probe.found) == expect_reads, (loop, probe.found[:3])


@pytest.mark.parametrize("extra", [dict(max_new_tokens=1), dict(max_new_tokens=9, prefill_chunk_size=7)])
def test_one_token_and_chunked_prefill(extra):
    model = tiny_model("qwen3")
    ids, mask = _batch()
    gen = dict(do_sample=False, pad_token_id=0, **extra)
    stock = model.generate(ids, attention_mask=mask, **with_cache(model, _cache(model, "mlstm")), **gen)
    ahead = model.generate(ids, attention_mask=mask, **with_cache(model, _cache(model, "mlstm")), **gen,
                           custom_generate=run_ahead_sample)
    assert torch.equal(stock, ahead) and ahead.shape[1] == ids.shape[1] + extra["max_new_tokens"]


def test_static_cache_object():
    model = tiny_model("qwen3", attn="sdpa")
    ids, mask = _batch()
    gen = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    caches = [StaticCache(config=model.config, max_cache_len=ids.shape[1] + 16) for _ in range(2)]
    stock = model.generate(ids, attention_mask=mask, **with_cache(model, caches[0]), **gen)
    ahead = model.generate(ids, attention_mask=mask, **with_cache(model, caches[1]), **gen,
                           custom_generate=run_ahead_sample)
    assert torch.equal(stock, ahead)
