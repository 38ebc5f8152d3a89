"""Compiled decode steps of hybrid models with a KVpopCache: one graph, compiled once, the same tokens as eager.

A decode step (one query per row) of every hybrid class of ``hybrid_helpers`` (sliding layers that keep their window,
``sliding_layers="window"``, and KVpop on the sliding layers, ``"kvpop"``) must trace into one graph with no break:
a break cuts the step into per-layer frames, which dynamo then compiles once per ``layer_idx`` until it reaches its
recompile limit and runs the step eagerly (issue 66). ``generate``'s own compile of the decode step (the way it
compiles on a GPU, here forced onto the CPU with the ``eager`` backend, ``fullgraph=True``) and a direct
``torch.compile(model.forward)`` must compile once over the whole generation (``error_on_recompile``) and give
exactly what eager decoding gives."""

import copy

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import CompileConfig

from hybrid_helpers import HYBRIDS, VOCAB, WINDOW, hybrid_model, sliding_choice
from helpers import left_padded
from kvpop_hf import KVpopCache
from kvpop_hf.compat import with_cache

pytestmark = pytest.mark.tier("unit")

# (class, sliding_layers): each class with its default choice, and KVpop on the sliding layers where it has any
CASES = sorted({(name, sliding_choice(name)) for name in HYBRIDS}
               | {(name, "kvpop") for name in ("gemma2", "gemma3", "gpt_oss", "olmo3", "qwen2")})
IDS = [f"{name}-{sliding}" for name, sliding in CASES]
PROMPT = 12  # longer than the window (8): the sliding layers are full when decoding starts


def _ids(batch=1, length=PROMPT, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=g)


def _cache(model, sliding):
    return KVpopCache(model.config, sinks=2, window=4, topk=4, scorer="knorm", sliding_layers=sliding)


class Graphs:
    """A backend that runs each graph it is given eagerly and counts them. generate deep-copies its compile config,
    so the count lives in a list that a function (copied as itself) shares."""

    def __init__(self):
        self.compiled = []
        compiled = self.compiled

        def backend(gm, example_inputs):
            compiled.append(gm)
            return gm.forward

        self.backend = backend

    @property
    def frame_count(self) -> int:
        return len(self.compiled)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name,sliding", CASES, ids=IDS)
def test_decode_step_traces_into_one_graph(name, sliding):
    model = hybrid_model(name)
    cache = _cache(model, sliding)
    ids = _ids()
    with torch.no_grad():
        logits = model(ids, **with_cache(model, cache, use_cache=True)).logits
        step = dict(input_ids=logits[:, -1:].argmax(-1), position_ids=torch.tensor([[PROMPT]]))
        explained = torch._dynamo.explain(model.forward)(**step, **with_cache(model, cache, use_cache=True))
    reasons = [r.reason.splitlines()[0] for r in explained.break_reasons]
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), reasons


def _generate(model, cache, ids, compiled, backend="eager", **gen):
    config = CompileConfig(backend=backend, mode=None, fullgraph=True)
    config._compile_all_devices = True  # generate compiles decode steps on CUDA only, unless told so
    with torch.no_grad():
        return model.generate(ids, **with_cache(model, cache), max_new_tokens=6, do_sample=False,
                              disable_compile=not compiled, compile_config=config, return_dict_in_generate=True,
                              output_logits=True, **gen)


def _assert_same(out, ref):
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# a prompt longer than the window, and one shorter (the layers that keep their window fill it while decoding)
GENERATE_CASES = [(name, sliding, PROMPT) for name, sliding in CASES] + [
    (name, sliding, WINDOW // 2) for name, sliding in CASES if sliding == "window"]


@pytest.mark.parametrize("name,sliding,prompt", GENERATE_CASES,
                         ids=[f"{n}-{s}-prompt{p}" for n, s, p in GENERATE_CASES])
def test_generate_compiles_the_decode_step_once(name, sliding, prompt):
    """generate's compiled decode step: one frame compiled, no recompilation, the tokens and logits of eager."""
    model = hybrid_model(name)
    ids = _ids(length=prompt)
    ref = _generate(model, _cache(model, sliding), ids, compiled=False)
    graphs = Graphs()
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = _generate(model, _cache(model, sliding), ids, compiled=True, backend=graphs.backend)
    assert graphs.frame_count == 1
    assert not counters["graph_break"]
    _assert_same(out, ref)


@pytest.mark.parametrize("name", ["gemma3", "gpt_oss"])
def test_generate_compiled_left_padded_batch(name):
    """A padded batch: the padding is in the masks generate builds ahead of the compiled step."""
    model = hybrid_model(name)
    rows = [_ids(1, n, seed=n)[0] for n in (PROMPT, PROMPT - 7, PROMPT - 3)]
    ids, mask, _ = left_padded(rows)
    ref = _generate(model, _cache(model, "window"), ids, compiled=False, attention_mask=mask)
    graphs = Graphs()
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = _generate(model, _cache(model, "window"), ids, compiled=True, backend=graphs.backend, attention_mask=mask)
    assert graphs.frame_count == 1
    _assert_same(out, ref)


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "gpt_oss", "olmo3", "qwen3_next"])
def test_compiled_forward_decodes_without_recompiling(name):
    """torch.compile(model.forward) over several decode steps (the masks built inside the graph): compiled once,
    the logits of the same steps run eagerly on a copy of the cache."""
    model = hybrid_model(name)
    cache = _cache(model, sliding_choice(name))
    with torch.no_grad():
        token = model(_ids(), **with_cache(model, cache, use_cache=True)).logits[:, -1:].argmax(-1)
        eager_cache = copy.deepcopy(cache)
        graphs = Graphs()
        forward = torch.compile(model.forward, backend=graphs.backend, fullgraph=True)
        eager_token = token
        with torch._dynamo.config.patch(error_on_recompile=True):
            for step in range(5):
                pos = torch.tensor([[PROMPT + step]])
                logits = forward(input_ids=token, position_ids=pos, **with_cache(model, cache, use_cache=True)).logits
                ref = model(input_ids=eager_token, position_ids=pos,
                            **with_cache(model, eager_cache, use_cache=True)).logits
                torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
                token, eager_token = logits[:, -1:].argmax(-1), ref[:, -1:].argmax(-1)
                assert torch.equal(token, eager_token)
    assert graphs.frame_count == 1


def test_generate_with_inductor_compiles_once():
    """The backend generate uses on a GPU (inductor, here its CPU code): one graph, compiled once, eager's tokens."""
    model = hybrid_model("gemma2")  # softcap on the KVpop layer and on the sliding layer that keeps its window
    ids = _ids()
    ref = _generate(model, _cache(model, "window"), ids, compiled=False)
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = _generate(model, _cache(model, "window"), ids, compiled=True, backend="inductor")
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
