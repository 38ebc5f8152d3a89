"""Greedy generation with KVpopCaches of several scorers. ``tests/test_tensor_parallel.py`` calls :func:`run` in
its own process and launches this script under ``torch.distributed.run --nproc_per_node 2``: the model then
loads with ``tp_plan="auto"`` over gloo and rank 0 prints one JSON line with every rank's tokens and cache
shapes. Half the caches are built from the model, half from its config (both seams).

    python -m torch.distributed.run --nproc_per_node 2 tests/tp_generate_script.py MODEL_DIR
"""

import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, DistributedConfig, DynamicCache

from kvpop_hf import KVpopCache
from kvpop_hf.compat import with_cache

SCORERS = {"knorm": {}, "random": {}, "mlp": {"hidden": 8}, "mlstm": {"state_dim": 8}, "kvp": {"hidden": 8},
           "h2o": {}}
BUDGET = dict(sinks=2, window=4, topk=4)  # 10 slots per head for a 24-token prompt + 12 new tokens


def run(path, tp):
    # what from_pretrained(..., tp_plan="auto") does, without its deprecation warning (transformers 5.24)
    kwargs = dict(distributed_config=DistributedConfig(tp_plan="auto")) if tp else {}
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="kvpop", **kwargs).eval()
    ids = torch.randperm(256, generator=torch.Generator().manual_seed(1))[:24][None]
    gen = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    result = {"dynamic": model.generate(ids, **with_cache(model, DynamicCache(config=model.config), **gen))[0, 24:].tolist()}
    heads = {}
    for i, (name, scorer_kwargs) in enumerate(SCORERS.items()):
        cache = KVpopCache(model.config if i % 2 else model, scorer=name, scorer_kwargs=scorer_kwargs,
                           log_gamma=-0.05 if name == "mlp" else None, **BUDGET)
        result[name] = model.generate(ids, **with_cache(model, cache, **gen))[0, 24:].tolist()
        heads[name] = {"tp_kv_heads": cache.tp_kv_heads, "keys": [list(layer.keys.shape) for layer in cache.layers],
                       "scorer_heads": cache.scorer.num_kv_heads,
                       "log_gamma": None if cache.log_gamma is None else list(cache.log_gamma.shape)}
    if not tp:
        return [{"tokens": result, "heads": heads}]
    import torch.distributed as dist

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, {"tokens": result, "heads": heads})
    dist.destroy_process_group()
    return every


if __name__ == "__main__":
    out = run(sys.argv[1], tp="RANK" in os.environ)
    if int(os.environ.get("RANK", 0)) == 0:
        print("RESULT " + json.dumps(out))
