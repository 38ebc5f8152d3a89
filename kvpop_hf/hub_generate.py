"""The ``generate`` that a KVpop checkpoint folder's ``custom_generate/generate.py`` hands to transformers.

transformers' ``custom_generate`` hook: when ``from_pretrained(folder, trust_remote_code=True)`` finds
``custom_generate/generate.py`` in the folder it loads from, ``model.generate`` becomes that file's ``generate``
(``model.generate(..., custom_generate=folder, trust_remote_code=True)`` runs it for one call). A folder written by
``KVpopTrainer`` holds :data:`HOOK_SOURCE` there, which only imports :func:`generate` from this module, so
``model.generate(input_ids, max_new_tokens=N)`` decodes with the checkpoint's own cache and no other code:

1. the cache: ``KVpopCache.from_pretrained`` of the checkpoint, at its trained budget (a new cache per call);
2. the attention: ``"kvpop"`` (set on the model in place, once);
3. the prompt: fed by :func:`~kvpop_hf.prefill.prefill_in_chunks` in chunks of ``prefill_chunk_size`` tokens
   (default :data:`DEFAULT_PREFILL_CHUNK`), outside any compiled call;
4. the decoding: on CUDA, greedy and sampling run :func:`~kvpop_hf.run_ahead.run_ahead_sample` with the q/k/v and
   gate/up projections stored as one buffer each (:func:`~kvpop_hf.ops.fused_projections.fuse_projection_storage`,
   in place, once per model, where the model has such bias-free ``nn.Linear`` groups) and
   ``compile_config=fused_compile_config()``; other modes (beam search, assisted decoding, returned attentions)
   run transformers' own loop with the cache. On CPU: transformers' own loop with the cache.

Which checkpoint. ``kvpop_checkpoint=`` if given; else the folder or repo id of a ``custom_generate=`` string
that ``GenerationMixin.generate`` was called with (read from that call's arguments); else the folder the model
was loaded from (``model.name_or_path``). A Hub repo id is resolved through huggingface_hub's cache, as
``KVpopCache.from_pretrained`` does. A LoRA adapter folder is *not* the folder the model reports: transformers
loads an adapter folder's base model first and reports (and reads the ``custom_generate`` hook from) the base's
folder, so for adapters the hook runs only through ``custom_generate=adapter_dir`` (docs/usage.md).

Passed through unchanged: a call given its own cache (``past_key_values=`` or ``cache=``) runs transformers'
``generate`` as it is, with no attention change, no fusion and no prefill; so does a call that names another
``custom_generate`` repo. A ``custom_generate=`` callable of the caller's replaces the run-ahead loop. A
``streamer=`` is handed to the run-ahead loop as its ``stream_to=``. ``max_new_tokens``, sampling options,
``return_dict_in_generate`` (the returned ``past_key_values`` / ``cache`` is the KVpopCache used) and the other
``generate`` arguments keep their meaning.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["DEFAULT_PREFILL_CHUNK", "HOOK_SOURCE", "generate", "write_hook"]

DEFAULT_PREFILL_CHUNK = 16384

HOOK_DIR = "custom_generate"
HOOK_FILE = "generate.py"
# what a checkpoint folder carries: transformers copies this file into its modules cache and calls `generate`
HOOK_SOURCE = '''"""transformers' custom_generate hook of a KVpop checkpoint: generate with the checkpoint's own
KVpopCache, chunked prefill and the device's fastest decoding loop (kvpop_hf/hub_generate.py in kvpop-hf, which
must be installed)."""

from kvpop_hf.hub_generate import generate  # noqa: F401
'''

_CACHE_KWARGS = ("past_key_values", "cache")


def write_hook(directory) -> Path:
    """Write ``custom_generate/generate.py`` (:data:`HOOK_SOURCE`) into ``directory``; returns the file."""
    path = Path(directory) / HOOK_DIR / HOOK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(HOOK_SOURCE)
    return path


def generate(*args: Any, model, kvpop_checkpoint: str | os.PathLike | None = None,
             prefill_chunk_size: int | None = None, **kwargs: Any):
    """``model.generate(*args, **kwargs)`` with the checkpoint's KVpopCache on the device's fastest path (module
    docstring). ``kvpop_checkpoint``: the KVpop checkpoint folder or Hub repo id (default: found as the module
    docstring says). ``prefill_chunk_size``: tokens per prefill chunk (default :data:`DEFAULT_PREFILL_CHUNK`)."""
    stock = type(model).generate  # the class's generate: model.generate is this hook once transformers installed it
    if any(kwargs.get(k) is not None for k in _CACHE_KWARGS) or isinstance(kwargs.get("custom_generate"), str):
        if prefill_chunk_size is not None:
            kwargs["prefill_chunk_size"] = prefill_chunk_size
        return stock(model, *args, **kwargs)
    for k in _CACHE_KWARGS:
        kwargs.pop(k, None)
    source = kvpop_checkpoint if kvpop_checkpoint is not None else _checkpoint_of(model)
    cache = _load_cache(source, model)
    if getattr(model.config, "_attn_implementation", None) != "kvpop":  # registered by `import kvpop_hf`
        model.set_attn_implementation("kvpop")

    input_ids = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    chunk = DEFAULT_PREFILL_CHUNK if prefill_chunk_size is None else prefill_chunk_size
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and input_ids.shape[1] >= 2:
        from .prefill import prefill_in_chunks

        prefill_in_chunks(model, cache, input_ids, chunk, attention_mask=kwargs.get("attention_mask"))

    if _device_type(model) == "cuda" and kwargs.get("custom_generate") is None and _run_ahead_fits(model, kwargs):
        from .run_ahead import run_ahead_sample

        kwargs["custom_generate"] = run_ahead_sample
        streamer = kwargs.pop("streamer", None)
        if streamer is not None:
            kwargs["stream_to"] = streamer
        if kwargs.get("compile_config") is None and _fuse_once(model):
            from .ops.fused_projections import fused_compile_config

            kwargs["compile_config"] = fused_compile_config()
    from .compat import with_cache

    return stock(model, *args, **with_cache(model, cache, **kwargs))


def _checkpoint_of(model) -> str:
    """The ``custom_generate=`` string of the ``GenerationMixin.generate`` call that called this hook, else the
    folder or repo id the model was loaded from."""
    frame = sys._getframe(2)  # generate's caller
    if frame.f_code.co_name == "generate" and frame.f_globals.get("__name__") == "transformers.generation.utils":
        named = frame.f_locals.get("custom_generate")
        if isinstance(named, (str, os.PathLike)):
            return os.fspath(named)
    name = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
    if not name:
        raise ValueError("kvpop_hf.hub_generate.generate: the model does not record the folder it was loaded from; "
                         "pass kvpop_checkpoint=<KVpop checkpoint folder or repo id>.")
    return str(name)


def _load_cache(source, model):
    from .cache import KVpopCache

    try:
        return KVpopCache.from_pretrained(source, model.config)
    except FileNotFoundError as err:
        raise FileNotFoundError(
            f"kvpop_hf.hub_generate.generate looked for the KVpop checkpoint in {source!r} and found none ({err}). "
            "A model loaded from a LoRA adapter folder reports its base model's folder: generate with "
            "model.generate(input_ids, custom_generate=ADAPTER_DIR, trust_remote_code=True, ...) or pass "
            "kvpop_checkpoint=ADAPTER_DIR.") from err


def _device_type(model) -> str:
    device = getattr(model, "device", None)
    if device is None:
        device = next(model.parameters()).device
    return torch.device(device).type


def _run_ahead_fits(model, kwargs: dict) -> bool:
    """Whether this call decodes greedily or by sampling, as ``run_ahead_sample`` does (no beams, no assistant,
    no attentions or hidden states returned, no synced GPUs)."""
    from transformers.generation.configuration_utils import GenerationMode

    if kwargs.get("assistant_model") is not None or kwargs.get("synced_gpus"):
        return False
    config = copy.deepcopy(kwargs.get("generation_config") or model.generation_config)
    config.update(**{k: v for k, v in kwargs.items() if hasattr(config, k) and k != "generation_config"})
    if config.return_dict_in_generate and (config.output_attentions or config.output_hidden_states):
        return False
    return config.get_generation_mode() in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)


def _fuse_once(model) -> bool:
    """Store the model's q/k/v and gate/up projections as one buffer each (once; again after a move split them
    apart); True when any group is stored so."""
    from .ops.fused_projections import DEFAULT_GROUPS, SharedStorageLinear, fuse_projection_storage

    shared = False
    for module in model.modules():
        for names in DEFAULT_GROUPS:
            linears = [getattr(module, n, None) for n in names]
            if all(isinstance(m, SharedStorageLinear) for m in linears):
                _reshare(linears)
                shared = True
    if shared:
        return True
    try:
        fuse_projection_storage(model)
    except ValueError:  # no bias-free nn.Linear group (biases, LoRA-wrapped projections): decode unfused
        return False
    return True


def _reshare(linears) -> None:
    """Point a fused group's weights and buffer at one buffer again (``model.to(...)`` copies each apart)."""
    stacked = linears[0].stacked
    if all(m.stacked is stacked and m.weight.data_ptr() == stacked[m.start:m.stop].data_ptr() for m in linears):
        return
    with torch.no_grad():
        stacked = torch.cat([m.weight.detach() for m in linears], dim=0)
    for m in linears:
        m.weight = torch.nn.Parameter(stacked[m.start:m.stop], requires_grad=m.weight.requires_grad)
        m.register_buffer("stacked", stacked, persistent=False)
