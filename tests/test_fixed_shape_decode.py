"""The fixed-shape decode path and the per-call hand-off between the cache and the attention function.

* compiled decoding (transformers' own ``compile_config`` path, one graph, no recompiles) gives the
  same tokens and logits as eager decoding, which the contract tests tie to the reference mask;
* the occupied slots are always the prefix the decode mask assumes;
* two caches in two threads, a nested model, an exception inside a forward: each call sees only its
  own chunk; a dropped cache is freed at once (no module state holds it).
"""

import gc
import threading
import weakref

import pytest
import torch
from transformers import CompileConfig

from helpers import distinct_ids, left_padded, reference_logits, run_chunks, run_tokens, tiny_model
from kvpop_hf import KVpopCache
from kvpop_hf.compat import with_cache

pytestmark = pytest.mark.tier("unit")

KW = dict(sinks=2, window=4, topk=6)


def compile_config(backend="eager"):
    cfg = CompileConfig(backend=backend, fullgraph=True, mode=None)
    cfg._compile_all_devices = True  # transformers compiles decode steps on CUDA only unless told so
    return cfg


def graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@pytest.mark.parametrize("scorer", ["knorm", "mlp", "mlstm", "kvp"])
def test_compiled_generate_equals_eager(scorer):
    model = tiny_model("qwen3")
    ids = distinct_ids(2, 20, seed=7)
    gen = dict(max_new_tokens=24, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    eager = model.generate(ids, **with_cache(model, KVpopCache(model.config, scorer=scorer, **KW)), **gen)
    torch._dynamo.reset()
    before = graphs_compiled()
    cache = KVpopCache(model.config, scorer=scorer, **KW)
    assert cache.is_compileable
    compiled = model.generate(ids, **with_cache(model, cache), compile_config=compile_config(), **gen)
    assert graphs_compiled() - before == 1, "decode steps must reuse one graph (no per-step recompiles)"
    assert torch.equal(compiled.sequences, eager.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(compiled.logits, eager.logits))
    assert diff < 1e-4, diff
    assert int(cache.get_seq_length()) == ids.shape[1] + 23  # the last new token is never fed back


def test_compiled_decode_matches_reference_mask_token_by_token():
    """Decode-only feeding (every token a decode step) through a compiled forward == reference mask."""
    model = tiny_model("llama")
    ids = distinct_ids(1, 36, seed=8)
    cache = KVpopCache(model.config, scorer="mlp", **KW)
    ref, _ = reference_logits(model, ids, cache.scorer, KW["sinks"], KW["window"], KW["topk"])
    torch._dynamo.reset()
    forward = lambda x: model(x, **with_cache(model, cache)).logits  # noqa: E731
    step = torch.compile(forward, backend="eager", fullgraph=True)
    with torch.no_grad():
        first = forward(ids[:, :1])  # eager: allocates the buffers (as generate's prefill does)
        before = graphs_compiled()
        out = torch.cat([first] + [step(ids[:, i:i + 1]) for i in range(1, ids.shape[1])], 1)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)
    assert graphs_compiled() - before == 1


def test_padded_batch_compiled_equals_rows_alone():
    model = tiny_model("qwen3")
    rows = [distinct_ids(1, n, seed=10 + n)[0] for n in (9, 17, 13)]
    ids, mask, _ = left_padded(rows)
    gen = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    batch = model.generate(ids, attention_mask=mask, **with_cache(model, KVpopCache(model.config, **KW)),
                           compile_config=compile_config(), **gen)
    for i, r in enumerate(rows):
        alone = model.generate(r[None], **with_cache(model, KVpopCache(model.config, **KW)), **gen)
        assert torch.equal(batch[i, -12:], alone[0, -12:])


def test_occupied_slots_are_a_prefix():
    """The decode mask (slot < seen) relies on this layout invariant, through chunks and steps."""
    model = tiny_model("qwen3")
    rows = [distinct_ids(1, n, seed=n)[0] for n in (5, 11, 19)]
    ids, mask, _ = left_padded(rows)
    cache = KVpopCache(model.config, scorer="mlstm", **KW)
    with torch.no_grad():
        model(ids, attention_mask=mask, **with_cache(model, cache))
        for step in range(15):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            model(ids[:, :1], attention_mask=mask, **with_cache(model, cache))
            for li in range(len(cache.layers)):
                pos = cache.stored_positions(li)
                n = cache.layers[li].seen.clamp(max=cache.budget)
                slot = torch.arange(cache.budget)
                assert torch.equal(pos >= 0, (slot < n[:, None, None]).expand_as(pos))


def test_decode_buffers_keep_their_storage():
    """CUDA graphs replay fixed addresses: decoding must update every buffer in place."""
    model = tiny_model("qwen3")
    ids = distinct_ids(1, 30, seed=3)
    cache = KVpopCache(model.config, scorer="mlstm", **KW)
    with torch.no_grad():
        model(ids[:, :10], **with_cache(model, cache))
        ptrs = [[t.data_ptr() for t in layer._buffers()] for layer in cache.layers]
        run_tokens(model, ids[:, 10:], cache)
    assert ptrs == [[t.data_ptr() for t in layer._buffers()] for layer in cache.layers]
    assert int(cache.get_seq_length()) == 30


def _chunked_logits(model, ids, cache, sizes):
    return run_chunks(model, ids, cache, sizes=sizes)


def test_two_caches_two_threads_equal_their_runs_alone():
    models = [tiny_model("qwen3", seed=0), tiny_model("llama", seed=1)]
    prompts = [distinct_ids(2, 60, seed=20), distinct_ids(2, 55, seed=21)]
    sizes = [(7, 3, 11), (5, 13, 2)]
    alone = [_chunked_logits(m, p, KVpopCache(m.config, scorer="mlp", **KW), s)
             for m, p, s in zip(models, prompts, sizes)]
    for _ in range(5):
        results = [None, None]
        barrier = threading.Barrier(2)

        def work(i):
            barrier.wait()
            results[i] = _chunked_logits(models[i], prompts[i], KVpopCache(models[i].config, scorer="mlp", **KW),
                                         sizes[i])

        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for got, want in zip(results, alone):
            assert torch.equal(got, want)


def test_nested_model_inside_a_forward():
    """A model run (with its own KVpopCache) inside another model's forward does not disturb either."""
    outer, inner = tiny_model("qwen3", seed=0), tiny_model("qwen3", seed=1)
    ids_o, ids_i = distinct_ids(1, 40, seed=30), distinct_ids(1, 33, seed=31)
    want_o = run_chunks(outer, ids_o, KVpopCache(outer.config, **KW), sizes=(20, 20))
    want_i = run_chunks(inner, ids_i, KVpopCache(inner.config, **KW), sizes=(33,))
    got_i = []
    inner_cache = KVpopCache(inner.config, **KW)

    def hook(module, args, kwargs):
        if not got_i:
            with torch.no_grad():
                got_i.append(inner(ids_i, **with_cache(inner, inner_cache)).logits)

    handle = outer.model.layers[1].self_attn.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        got_o = run_chunks(outer, ids_o, KVpopCache(outer.config, **KW), sizes=(20, 20))
    finally:
        handle.remove()
    torch.testing.assert_close(got_o, want_o, atol=0, rtol=0)
    torch.testing.assert_close(got_i[0], want_i, atol=0, rtol=0)


def test_exception_inside_a_forward_leaks_nothing():
    model = tiny_model("qwen3")
    ids = distinct_ids(1, 30, seed=40)
    want = run_chunks(model, ids, KVpopCache(model.config, **KW), sizes=(12, 18))

    def boom(module, args, kwargs):
        raise RuntimeError("boom")

    handle = model.model.layers[1].self_attn.register_forward_pre_hook(boom, with_kwargs=True)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            run_chunks(model, ids, KVpopCache(model.config, **KW), sizes=(12, 18))
    finally:
        handle.remove()
    torch.testing.assert_close(run_chunks(model, ids, KVpopCache(model.config, **KW), sizes=(12, 18)), want,
                               atol=0, rtol=0)


@pytest.mark.parametrize("attn", ["kvpop", "sdpa"])
def test_dropped_cache_is_freed_without_garbage_collection(attn):
    model = tiny_model("qwen3", attn=attn)
    ids = distinct_ids(1, 30, seed=50)
    gc.collect()
    gc.disable()  # reference counting alone must free it: no cycles, no module-level records
    try:
        cache = KVpopCache(model.config, **KW)
        with torch.no_grad():
            model(ids[:, :20], **with_cache(model, cache))  # a chunk (left pending with sdpa)
            model(ids[:, 20:21], **with_cache(model, cache))  # a decode step
        ref = weakref.ref(cache)
        keys = weakref.ref(cache.layers[0].keys)
        del cache
        assert ref() is None and keys() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("attn", ["kvpop", "sdpa"])
def test_forwards_leave_no_reference_cycles_with_tensors(attn):
    """Chunk candidates must be freed when the forward returns: a cycle (keys -> chunk -> plan -> keys)
    would keep every layer's candidates alive until the garbage collector runs."""
    model = tiny_model("qwen3", attn=attn)
    ids = distinct_ids(1, 40, seed=51)
    cache = KVpopCache(model.config, scorer="mlstm", **KW)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        with torch.no_grad():
            model(ids[:, :25], **with_cache(model, cache))
            model(ids[:, 25:39], **with_cache(model, cache))
            model(ids[:, 39:40], **with_cache(model, cache))
        gc.collect()
        cyclic = [o for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert not cyclic, f"{len(cyclic)} tensors were only reachable through reference cycles"


def test_chunked_prefill_through_the_compiled_call_equals_eager():
    """With `prefill_chunk_size`, generate sends the prompt chunks through the compiled call as well; the
    cache's chunk updates (and the first allocation) and their attention run eagerly inside it (graph
    breaks), so no buffer is ever created inside a captured graph. Tokens and logits equal eager runs."""
    model = tiny_model("qwen3")
    ids = distinct_ids(2, 37, seed=3)
    gen = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, prefill_chunk_size=8, output_logits=True,
               return_dict_in_generate=True)
    eager = model.generate(ids, **with_cache(model, KVpopCache(model.config, **KW)), **gen)
    torch._dynamo.reset()
    cfg = CompileConfig(backend="eager", fullgraph=False, mode=None)
    cfg._compile_all_devices = True
    cache = KVpopCache(model.config, **KW)
    # each layer's pieces compile apart: raise the limit (torch's config.patch; pytest's monkeypatch would
    # delete the config entry on undo, as it does not see the module's attribute)
    with torch._dynamo.config.patch(recompile_limit=64):
        compiled = model.generate(ids, **with_cache(model, cache), compile_config=cfg, **gen)
    assert torch.equal(compiled.sequences, eager.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(compiled.logits, eager.logits))
    assert diff < 1e-4, diff
    # 37 tokens = 5 eager chunk updates; the 9 decode steps ran as compiled code (they count only when eager)
    assert all(layer.updates == 5 for layer in cache.layers)


def test_chunk_in_a_compiled_call_where_unsupported_raises_a_clear_error(monkeypatch):
    """On CUDA a prompt chunk inside a compiled forward is refused (CUDA graphs and the chunk path's graph
    breaks do not mix); forced here on CPU, the error reaches the caller, names the fix, and nothing was
    stored."""
    import kvpop_hf.layer as layer_mod

    monkeypatch.setattr(layer_mod, "chunk_in_compiled_call_unsupported", lambda key_states: True)
    model = tiny_model("qwen3")
    ids = distinct_ids(2, 37, seed=3)
    cfg = CompileConfig(backend="eager", fullgraph=False, mode=None)
    cfg._compile_all_devices = True
    cache = KVpopCache(model.config, **KW)
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="prefill_in_chunks"):
        model.generate(ids, **with_cache(model, cache), compile_config=cfg, max_new_tokens=4, do_sample=False,
                       pad_token_id=0, prefill_chunk_size=8)
    assert int(cache.get_seq_length()) == 0


@pytest.mark.parametrize("padded", [False, True])
def test_prefill_in_chunks_then_compiled_generate_equals_chunked_generate(padded):
    """The documented path for long prompts with compiled decoding: chunks fed eagerly, then generate (one
    eager prompt token, every decode step through the compiled call, fullgraph) -- same tokens and logits as
    generate's own chunked prefill run eagerly."""
    from kvpop_hf import prefill_in_chunks

    model = tiny_model("qwen3")
    if padded:
        ids, mask, _ = left_padded([distinct_ids(1, n, seed=20 + n)[0] for n in (37, 29)])
    else:
        ids, mask = distinct_ids(2, 37, seed=3), None
    extra = {} if mask is None else {"attention_mask": mask}
    gen = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    eager = model.generate(ids, **with_cache(model, KVpopCache(model.config, **KW)), prefill_chunk_size=8,
                           **extra, **gen)
    torch._dynamo.reset()
    before = graphs_compiled()
    cache = KVpopCache(model.config, **KW)
    prefill_in_chunks(model, cache, ids, 8, attention_mask=mask)
    assert int(cache.get_seq_length()) == ids.shape[1] - 1
    compiled = model.generate(ids, **with_cache(model, cache), compile_config=compile_config(), **extra, **gen)
    assert graphs_compiled() - before == 1
    assert torch.equal(compiled.sequences, eager.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(compiled.logits, eager.logits))
    assert diff < 1e-4, diff


def test_prefill_in_chunks_rejects_bad_input():
    from kvpop_hf import prefill_in_chunks

    model = tiny_model("qwen3")
    ids = distinct_ids(1, 12, seed=1)
    with pytest.raises(ValueError, match="chunk_size"):
        prefill_in_chunks(model, KVpopCache(model.config, **KW), ids, 0)
    with pytest.raises(ValueError, match="n >= 2"):
        prefill_in_chunks(model, KVpopCache(model.config, **KW), ids[:, :1], 4)
    with pytest.raises(ValueError, match="attention_mask"):
        prefill_in_chunks(model, KVpopCache(model.config, **KW), ids, 4, attention_mask=torch.ones(1, 5))
    cache = KVpopCache(model.config, **KW)
    prefill_in_chunks(model, cache, ids, 4)
    with pytest.raises(ValueError, match="already holds 11 tokens"):
        prefill_in_chunks(model, cache, ids, 4)


def test_graph_after_a_static_cache_graph_keeps_the_slot_dimension_static():
    """generate shares one compiled call between caches. After a StaticCache graph (buffers of the same names,
    another length), dynamo's automatic dynamic shapes would make KVpop's slot dimension symbolic; on CUDA that
    graph failed to compile (inductor KeyError 'op25'). Every dimension but the batch must stay static, and the
    tokens must equal eager decoding."""
    shapes = []

    def recording_backend(gm, example_inputs):
        for node in gm.graph.nodes:
            value = node.meta.get("example_value")
            if node.op == "placeholder" and isinstance(value, torch.Tensor) and "cache_layers" in node.name:
                shapes.append((node.name, [str(d) for d in value.shape]))
        return gm.forward

    model = tiny_model("qwen3")
    cfg = compile_config(backend=recording_backend)
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    torch._dynamo.reset()
    try:
        model.set_attn_implementation("sdpa")
        model.generate(distinct_ids(2, 30, seed=1), cache_implementation="static", compile_config=cfg, **gen)
        model.set_attn_implementation("kvpop")
        shapes.clear()
        ids = distinct_ids(3, 30, seed=2)
        compiled = model.generate(ids, **with_cache(model, KVpopCache(model.config, scorer="mlstm", **KW)),
                                  compile_config=cfg, **gen)
    finally:
        torch._dynamo.reset()
    eager = model.generate(ids, **with_cache(model, KVpopCache(model.config, scorer="mlstm", **KW)), **gen)
    assert any(name.endswith("keys") for name, _ in shapes), "the KVpop graph was compiled with the cache's keys"
    symbolic = [(name, dims) for name, dims in shapes if any(not d.isdigit() for d in dims[1:])]
    assert symbolic == [], symbolic
    assert torch.equal(compiled, eager)
