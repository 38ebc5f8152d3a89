"""One matrix product for sibling projections in compiled decoding (``kvpop_hf.ops.fused_projections``).

* the storage fusion changes nothing eager code computes, and every projection's weight is a view of one buffer;
* the inductor pass, run by ``generate`` through ``fused_compile_config``, removes the products it should (q/k/v and
  gate/up: four per layer) and the compiled tokens and logits equal eager decoding;
* a model without the fused storage keeps every product (the pass reads row blocks in the graph, not names);
* a second process loads the fused graph from the compile cache, and an unfused model never reads it;
* bad input is refused before any work.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._functorch.config
from torch import nn

from helpers import distinct_ids, tiny_model
from kvpop_hf import KVpopCache
from kvpop_hf.compat import with_cache
from kvpop_hf.ops.fused_projections import (AdjacentMatmulFusion, SharedStorageLinear, fuse_adjacent_matmuls,
                                        fuse_projection_storage, fused_compile_config)

pytestmark = pytest.mark.tier("unit")

KW = dict(sinks=2, window=4, topk=6)


@pytest.fixture(autouse=True)
def _no_autograd_cache():  # a cached graph would skip the pass these tests count
    with torch._functorch.config.patch(enable_autograd_cache=False):
        yield


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_storage_fusion_keeps_eager_outputs_and_shares_one_buffer(arch):
    model = tiny_model(arch)
    ids = distinct_ids(2, 12, seed=3)
    with torch.no_grad():
        before = model(ids).logits
        state = {k: v.clone() for k, v in model.state_dict().items()}
    assert fuse_projection_storage(model) == 2 * model.config.num_hidden_layers
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert type(attn.k_proj) is SharedStorageLinear
    assert "self_attn.k_proj.stacked" not in model.state_dict()  # the buffer is not saved twice
    ptr = attn.q_proj.weight.untyped_storage().data_ptr()
    assert attn.k_proj.weight.untyped_storage().data_ptr() == ptr == attn.v_proj.weight.untyped_storage().data_ptr()
    assert attn.k_proj.weight.storage_offset() == attn.q_proj.weight.numel()
    assert mlp.up_proj.weight.storage_offset() == mlp.gate_proj.weight.numel()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_a_fused_model_saves_and_loads_as_the_original(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model("qwen3")
    fuse_projection_storage(model)
    model.save_pretrained(tmp_path / "m")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert type(loaded.model.layers[0].self_attn.q_proj) is nn.Linear
    state = model.state_dict()
    assert loaded.state_dict().keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in loaded.state_dict().items())


class _Counted(AdjacentMatmulFusion):
    removed = 0

    def __call__(self, graph):
        type(self).removed += fuse_adjacent_matmuls(graph)


@pytest.mark.parametrize("scorer", ["knorm", "mlstm"])
def test_compiled_generate_with_the_pass_equals_eager(scorer):
    model = tiny_model("qwen3")
    ids = distinct_ids(2, 20, seed=7)
    gen = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    eager = model.generate(ids, **with_cache(model, KVpopCache(model.config, scorer=scorer, **KW)), **gen)
    fuse_projection_storage(model)
    torch._dynamo.reset()
    cfg = fused_compile_config(mode="default")
    cfg.options.update(post_grad_custom_post_pass=_Counted(), fx_graph_cache=False)  # the pass runs, not a cache
    cfg._compile_all_devices = True  # transformers compiles decode steps on CUDA only unless told so
    _Counted.removed = 0
    compiled = model.generate(ids, **with_cache(model, KVpopCache(model.config, scorer=scorer, **KW)),
                              compile_config=cfg, **gen)
    assert _Counted.removed == 3 * model.config.num_hidden_layers  # q/k/v: 2 fewer, gate/up: 1 fewer
    assert torch.equal(compiled.sequences, eager.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(compiled.logits, eager.logits))
    assert diff < 1e-4, diff


def test_pass_leaves_separate_weights_alone():
    class Three(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(16, n, bias=False) for n in (16, 8, 8))

        def forward(self, x):
            return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)

    x = torch.randn(3, 16)
    for fused in (False, True):
        m = Three()
        if fused:
            fuse_projection_storage(m)
        counted = _Counted()
        _Counted.removed = 0
        torch._dynamo.reset()
        out = torch.compile(m, options={"post_grad_custom_post_pass": counted, "fx_graph_cache": False})(x)
        assert _Counted.removed == (2 if fused else 0)
        torch.testing.assert_close(out, m(x))


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="no group of bias-free nn.Linear"):
        fuse_projection_storage(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="unknown mode"):
        fused_compile_config(mode="fast")


def test_pass_equality_and_cache_key():
    a, b = AdjacentMatmulFusion(), AdjacentMatmulFusion()
    assert a == b and hash(a) == hash(b) and a.uuid() == b.uuid()
    cfg = fused_compile_config("max-autotune")
    assert cfg.mode is None and cfg.options["max_autotune"] and cfg.options["triton.cudagraphs"]
    default = fused_compile_config()  # CompileConfig's own mode, as generate's default compile_config
    assert default.mode is None and default.options["triton.cudagraphs"] and "max_autotune" not in default.options


CACHE_SCRIPT = r"""
import json, sys, torch
from torch import nn
from torch._dynamo.utils import counters
from kvpop_hf.compile_cache import enable_compile_cache
from kvpop_hf.ops.fused_projections import AdjacentMatmulFusion, fuse_projection_storage

class Three(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(32, n, bias=False) for n in (32, 8, 8))
    def forward(self, x):
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1).relu()

enable_compile_cache(sys.argv[1])
torch.manual_seed(0)
m = Three()
if sys.argv[2] == "fused":
    fuse_projection_storage(m)
x = torch.randn(2, 32)
with torch.no_grad():
    out = torch.compile(m, options={"post_grad_custom_post_pass": AdjacentMatmulFusion()})(x)
    ok = torch.allclose(out, m(x), atol=1e-5)
print(json.dumps({"hit": counters["inductor"]["fxgraph_cache_hit"], "miss": counters["inductor"]["fxgraph_cache_miss"],
                  "ok": ok}))
"""


def _cache_run(directory, variant):
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", CACHE_SCRIPT, str(directory), variant], capture_output=True,
                         text=True, env=env, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.tier("scripts")  # another process or the command line
def test_compile_cache_reuses_the_fused_graph_and_keeps_it_apart(tmp_path):
    """A second process loads the fused graph from the compile cache; an unfused model compiles its own graph
    (the row blocks are in the graph, so the cache key differs) instead of reading the fused one."""
    first = _cache_run(tmp_path, "fused")
    assert first["miss"] >= 1 and first["hit"] == 0 and first["ok"]
    second = _cache_run(tmp_path, "fused")
    assert second["hit"] >= 1 and second["miss"] == 0 and second["ok"]
    plain = _cache_run(tmp_path, "separate")
    assert plain["miss"] >= 1 and plain["hit"] == 0 and plain["ok"]


def test_pass_fuses_only_blocks_that_tile_rows():
    """Row blocks with a gap, a stride or a column slice are left alone; blocks that tile are fused, and the
    rewritten graph computes the same values."""
    buf = torch.randn(40, 16)
    x = torch.randn(3, 16)

    def mm(x, w):  # a linear layer's product as it reaches inductor's post-grad graph
        return torch.mm(x, w.permute(1, 0))

    def tiled(x, b):
        return torch.cat([mm(x, b[0:16]), mm(x, b[16:24]), mm(x, b[24:40])], -1)

    def gapped(x, b):
        return torch.cat([mm(x, b[0:16]), mm(x, b[20:28]), mm(x, b[0:40:2]), mm(x, b[:, 0:16])], -1)

    for fn, expected in ((tiled, 2), (gapped, 0)):
        gm = torch.fx.experimental.proxy_tensor.make_fx(fn, tracing_mode="fake")(x, buf)
        got = fuse_adjacent_matmuls(gm.graph)
        gm.recompile()
        assert got == expected, fn.__name__
        torch.testing.assert_close(gm(x, buf), fn(x, buf))
