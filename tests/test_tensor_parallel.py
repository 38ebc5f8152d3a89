"""Tensor-parallel serving (kvpop_hf/tensor_parallel.py).

Two gloo processes (``torch.distributed.run``, the model loaded with ``tp_plan="auto"``: transformers' tensor
parallelism runs on CPU) generate the same greedy tokens as one process with KVpopCaches that evict, each rank
holding half the KV heads. The rest runs without a process group: the scorer slices against the full scorer,
and the errors on a simulated tensor-parallel model (``_tp_size`` and a stub mesh, as transformers sets them).
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from helpers import distinct_ids, tiny_config, tiny_model
from kvpop_hf import KVpopCache
from kvpop_hf.compat import with_cache
from kvpop_hf.scorers import Scorer, build_scorer
from kvpop_hf.tensor_parallel import slice_scorer

pytestmark = pytest.mark.tier("unit")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.tier("scripts")  # another process or the command line
def test_two_gloo_ranks_generate_the_single_process_tokens(tmp_path):
    from tp_generate_script import SCORERS, run

    tiny_model("qwen3", attn="sdpa").save_pretrained(tmp_path / "model")
    single = run(tmp_path / "model", tp=False)[0]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           "29541", str(ROOT / "tests" / "tp_generate_script.py"), str(tmp_path / "model")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert len(ranks) == 2
    for name in SCORERS:
        assert single["tokens"][name] != single["tokens"]["dynamic"], f"{name}: the budget did not change the tokens"
        for rank, got in enumerate(ranks):
            assert got["tokens"][name] == single["tokens"][name], (name, rank)
            heads = got["heads"][name]
            assert heads["tp_kv_heads"] == [rank, rank + 1]  # 2 KV heads over 2 ranks
            assert heads["keys"] == [[1, 1, 10, 16]] * 2 and heads["scorer_heads"] == 1
        assert single["heads"][name]["keys"] == [[1, 2, 10, 16]] * 2
    assert [r["heads"]["mlp"]["log_gamma"] for r in ranks] == [[2, 1], [2, 1]]


class _Mesh:
    def __init__(self, rank):
        self.rank = rank

    def get_mesh(self, dims):
        assert dims == "tp"
        return SimpleNamespace(get_local_rank=lambda: self.rank)


def _as_tensor_parallel(model, rank, tp_size=2):
    """What transformers' maybe_distribute_model records on a model it shards (the weights stay whole here)."""
    model._tp_size = tp_size
    model._mesh_manager = _Mesh(rank)
    return model


@pytest.mark.parametrize("name, kwargs", [("mlp", {"hidden": 8}), ("mlstm", {"state_dim": 4}), ("kvp", {"hidden": 8}),
                                          ("mlstm", {"state_dim": 4, "token_readout": True}), ("random", {}),
                                          ("knorm", {}), ("keydiff", {})])
def test_sliced_scorer_scores_its_heads_like_the_full_scorer(name, kwargs):
    full = build_scorer(name, 2, 4, 16, **kwargs)
    part = slice_scorer(full, 1, 3)
    assert part.num_kv_heads == 2 and full.num_kv_heads == 4
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 4, 7, 16, generator=g), torch.randn(2, 4, 7, 16, generator=g)
    pos = torch.arange(7).expand(2, 4, 7)
    for layer in range(2):
        if full.stateful:
            _, want = full.absorb_and_read(layer, full.init_state(layer, 2, k.device), k, v, None, k, v)
            _, got = part.absorb_and_read(layer, part.init_state(layer, 2, k.device), k[:, 1:3], v[:, 1:3], None,
                                          k[:, 1:3], v[:, 1:3])
        else:
            want, got = full.score(layer, k, v, pos), part.score(layer, k[:, 1:3], v[:, 1:3], pos[:, 1:3])
        torch.testing.assert_close(got, want[:, 1:3])


def test_cache_of_a_tensor_parallel_model_keeps_its_rank_heads(tmp_path):
    model = tiny_model("qwen3", attn="sdpa")
    full = KVpopCache(model.config, scorer="mlp", scorer_kwargs={"hidden": 8}, log_gamma=-0.1)
    full.log_gamma = torch.tensor([[-0.1, -0.2], [-0.3, -0.4]])
    full.save_pretrained(tmp_path)
    for rank in (0, 1):
        cache = KVpopCache.from_pretrained(tmp_path, _as_tensor_parallel(model, rank))
        assert cache.tp_kv_heads == (rank, rank + 1)
        assert torch.equal(cache.scorer.w1, full.scorer.w1[:, rank:rank + 1])
        assert torch.equal(cache.log_gamma, full.log_gamma[:, rank:rank + 1])
        assert cache.kvpop_config.num_kv_heads == 2  # the config still describes the whole model
        with pytest.raises(ValueError, match="one tensor-parallel rank"):
            cache.save_pretrained(tmp_path / "again")
        # a rank's attention hands the cache one head per layer
        k = torch.randn(1, 1, 5, 16)
        cache.update(k, k, 0)
        assert cache.layers[0].keys.shape == (1, 1, cache.budget, 16)


def test_full_head_cache_on_a_rank_says_how_to_build_it():
    cache = KVpopCache(tiny_config(), sinks=1, window=2, topk=3)  # a config loaded apart from the sharded model
    k = torch.randn(1, 1, 5, 16)
    with pytest.raises(ValueError, match=r"tensor parallel .*KVpopCache\(model, \.\.\.\)"):
        cache.update(k, k, 0)


def test_unevenly_split_heads_are_refused():
    model = _as_tensor_parallel(tiny_model("qwen3", attn="sdpa", num_attention_heads=6, num_key_value_heads=3), 0)
    with pytest.raises(ValueError, match="3 KV heads do not split evenly over them"):
        KVpopCache(model)


def test_unsliceable_scorer_is_refused():
    class SharedScale(Scorer):  # one weight per head but no layer dimension: its layout is not [L, H, ...]
        def __init__(self):
            super().__init__(2, 2, 16)
            self.scale = nn.Parameter(torch.ones(2))

        def score(self, layer_idx, keys, values, positions):
            return -keys.float().norm(dim=-1) * self.scale[None, :, None]

    model = _as_tensor_parallel(tiny_model("qwen3", attn="sdpa"), 1)
    with pytest.raises(ValueError, match=r"SharedScale cannot be sliced.*\['scale'\].*head_slice"):
        KVpopCache(model, scorer=SharedScale())


def test_tensor_parallel_config_without_a_process_group_is_refused():
    cfg = tiny_config()
    cfg.distributed_config = SimpleNamespace(tp_size=2, tp_plan="auto")  # what transformers attaches under TP
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        KVpopCache(cfg)
    cfg.distributed_config = SimpleNamespace(tp_size=2, tp_plan={})  # an empty plan: nothing sharded
    assert KVpopCache(cfg).tp_kv_heads is None


def test_unsharded_model_is_untouched():
    model = tiny_model("qwen3", attn="sdpa")
    cache = KVpopCache(model, scorer="mlp")
    assert cache.tp_kv_heads is None and cache.scorer.num_kv_heads == 2
    ids = distinct_ids(1, 12)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, **with_cache(model, cache)).logits,
                                   model(ids, **with_cache(model, KVpopCache(model.config, scorer="mlp"))).logits)
