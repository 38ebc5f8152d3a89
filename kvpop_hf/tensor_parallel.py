"""Tensor-parallel serving: which KV heads this rank holds, and the scorer cut to them.

Under transformers' tensor parallelism (``from_pretrained(..., tp_plan="auto")`` or
``distributed_config=DistributedConfig(tp_size=N)``, launched with ``torchrun``) the ``k_proj``/``v_proj``
projections are split column-wise, so rank ``r`` of the ``tp`` mesh dimension computes the contiguous KV
heads ``[r * H / N, (r + 1) * H / N)`` and its attention (and its cache) only ever sees those. A
:class:`~kvpop_hf.KVpopCache` built from such a model (``KVpopCache(model, ...)``) or from its live config
(``KVpopCache(model.config, ...)``: transformers attaches the ``DistributedConfig`` to it) keeps slots for
these heads only, and its scorer's per-head weights (and the per-head decay) are sliced to them, so every
rank evicts exactly what one process would for the same heads.

Scorers: per-head parameters laid out ``[num_layers, num_kv_heads, ...]`` (mlp, mlstm, kvp) are sliced on
dim 1; stateless heuristics and the attention-based policies need nothing; "random" shifts its head index.
A scorer whose tensors have another layout cannot be sliced: it may define ``head_slice(start, stop)``
returning the scorer for those heads, else construction raises.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from .config import model_shape


def split_model_or_config(model_or_config):
    """``(config, model)`` from what a user passes as the cache's first argument: a model (has ``.config``
    and is a module) or a config (model None)."""
    if isinstance(model_or_config, nn.Module) and hasattr(model_or_config, "config"):
        return model_or_config.config, model_or_config
    return model_or_config, None


def tp_size_of(model_config, model=None) -> int:
    """The tensor-parallel size a model was loaded with (1 when it was not)."""
    if model is not None:
        return int(getattr(model, "_tp_size", None) or 1)
    dist_config = getattr(model_config, "distributed_config", None)
    return int(getattr(dist_config, "tp_size", None) or 1)


def _tp_plan(model_config, model=None) -> dict:
    if model is not None:
        return dict(getattr(model, "tp_plan", None) or {})
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    plan = dict(getattr(text, "base_model_tp_plan", None) or {})
    override = getattr(getattr(model_config, "distributed_config", None), "tp_plan", None)
    if isinstance(override, dict):  # transformers merges a dict override into the model's plan ({} disables TP)
        plan = plan | override if override else {}
    return plan


def _tp_rank(model, tp_size: int) -> int:
    mesh_manager = getattr(model, "_mesh_manager", None) if model is not None else None
    if mesh_manager is not None:
        return int(mesh_manager.get_mesh("tp").get_local_rank())
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"The model config says tensor parallelism over {tp_size} ranks, but torch.distributed is not "
            "initialized in this process, so this rank's KV heads are unknown. Build the KVpopCache on each rank "
            "of the torchrun launch, after from_pretrained(..., tp_plan='auto'), from the model: "
            "KVpopCache(model, ...)."
        )
    # transformers' mesh is (pp, dp_replicate, fsdp, tp) over ranks in order: tp is the innermost dimension
    return dist.get_rank() % tp_size


def local_kv_heads(model_config, model=None) -> tuple[int, int] | None:
    """``(start, stop)`` of the KV heads this rank's attention layers compute, or None when the model is not
    tensor parallel or its KV heads are not sharded (every rank holds them all)."""
    tp_size = tp_size_of(model_config, model)
    if tp_size <= 1:
        return None
    from transformers.distributed.tensor_parallel import get_kv_heads_per_rank

    heads = model_shape(model_config, "kvpop")[1]  # KV heads only: any attention layer will do
    per_rank = get_kv_heads_per_rank(_tp_plan(model_config, model), heads, tp_size)
    if per_rank is None:
        raise ValueError(
            f"The model is tensor parallel over {tp_size} ranks, but its {heads} KV heads do not split evenly "
            f"over them, so a rank's keys are not whole heads and KVpopCache cannot keep per-head slots. Use a "
            f"tensor-parallel size that divides {heads}, or split the model by layers instead "
            "(device_map='auto', docs/multi_gpu_serving.md)."
        )
    if per_rank == heads:
        return None
    rank = _tp_rank(model, tp_size)
    return rank * per_rank, (rank + 1) * per_rank


def slice_heads(tensor: torch.Tensor | None, heads: tuple[int, int] | None) -> torch.Tensor | None:
    """``tensor[:, start:stop]`` (a ``[num_layers, num_kv_heads, ...]`` tensor cut to this rank's heads)."""
    if tensor is None or heads is None:
        return tensor
    return tensor[:, heads[0]:heads[1]].clone()


def slice_scorer(scorer, start: int, stop: int):
    """A copy of ``scorer`` for KV heads ``[start, stop)`` of the model: per-head tensors (parameters and
    buffers laid out ``[num_layers, num_kv_heads, ...]``) sliced on dim 1, ``num_kv_heads = stop - start``.
    A scorer's own ``head_slice(start, stop)`` takes precedence. Raises a ValueError when a tensor has
    another layout (its heads cannot be told apart)."""
    if not 0 <= start < stop <= scorer.num_kv_heads:
        raise ValueError(f"KV heads [{start}, {stop}) are not within the scorer's {scorer.num_kv_heads} heads.")
    if hasattr(scorer, "head_slice"):
        return scorer.head_slice(start, stop)
    lead = (scorer.num_layers, scorer.num_kv_heads)
    named = list(scorer.named_parameters()) + list(scorer.named_buffers())
    bad = [name for name, t in named if tuple(t.shape[:2]) != lead]
    if bad:
        raise ValueError(
            f"This tensor-parallel rank holds KV heads [{start}, {stop}) of {scorer.num_kv_heads}, but the scorer "
            f"{type(scorer).__name__} cannot be sliced to them: its tensors {bad} are not laid out "
            f"[num_layers={lead[0]}, num_kv_heads={lead[1]}, ...]. Give the scorer a `head_slice(start, stop)` "
            "method, or serve without tensor parallelism (device_map='auto' splits the model by layers)."
        )
    part = copy.deepcopy(scorer)
    for name, t in named:
        module_name, _, leaf = name.rpartition(".")
        module = part.get_submodule(module_name)
        if leaf in module._parameters:
            module._parameters[leaf] = nn.Parameter(t.detach()[:, start:stop].clone(), requires_grad=t.requires_grad)
        else:
            module._buffers[leaf] = t[:, start:stop].clone()
    part.num_kv_heads = stop - start
    if hasattr(part, "head_offset"):  # scorers that read the head index (seeded random) see the model's index
        part.head_offset = getattr(scorer, "head_offset", 0) + start
    return part
