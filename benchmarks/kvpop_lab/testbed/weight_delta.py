"""A distilled student stored as the tensors that differ from its base model.

A LoRA retrofit merged into the weights changes only the adapted projections (the attention's q/k/v/o of every
layer for ``training/retrofit.py``), so a testbed student shares most of its ``model.safetensors`` with the
teacher it was distilled from. :func:`save_weight_delta` keeps only the differing tensors:
``model_delta.safetensors`` plus ``model_delta.json`` naming the base folder (relative to the student's) and the
SHA-256 of the base's ``model.safetensors``; :func:`load_model` (:mod:`kvpop_lab.testbed.models`) rebuilds the
student from the two, bit for bit. A changed or missing base is refused with an error that says so.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

__all__ = ["DELTA_CONFIG", "DELTA_WEIGHTS", "is_weight_delta", "save_weight_delta", "load_weight_delta"]

DELTA_CONFIG = "model_delta.json"
DELTA_WEIGHTS = "model_delta.safetensors"
_FULL = "model.safetensors"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def is_weight_delta(path) -> bool:
    """Whether the folder ``path`` holds a student stored as a weight delta."""
    return (Path(path) / DELTA_CONFIG).is_file()


def save_weight_delta(model_dir, base_dir) -> dict[str, int]:
    """Replace ``model_dir/model.safetensors`` by the tensors that differ (in dtype, shape or any bit) from
    ``base_dir/model.safetensors``. Both must hold the same tensor names. Returns ``{"kept": n, "total": m}``."""
    from safetensors.torch import load_file, save_file

    model_dir, base_dir = Path(model_dir), Path(base_dir)
    full, base_file = model_dir / _FULL, base_dir / _FULL
    for f in (full, base_file):
        if not f.is_file():
            raise FileNotFoundError(f"save_weight_delta: no {f}")
    student, base = load_file(full), load_file(base_file)
    if set(student) != set(base):
        raise ValueError(f"save_weight_delta: {model_dir} and {base_dir} hold different tensors "
                         f"({sorted(set(student) ^ set(base))[:4]}...); a delta needs the same architecture")
    delta = {k: v for k, v in student.items()
             if not (v.dtype == base[k].dtype and v.shape == base[k].shape and v.equal(base[k]))}
    save_file(delta, model_dir / DELTA_WEIGHTS, metadata={"format": "pt"})
    meta = {"base_model": os.path.relpath(base_dir.resolve(), model_dir.resolve()), "base_sha256": _sha256(base_file),
            "tensors": sorted(delta)}
    (model_dir / DELTA_CONFIG).write_text(json.dumps(meta, indent=1) + "\n")
    full.unlink()
    return {"kept": len(delta), "total": len(student)}


def load_weight_delta(path, dtype, device):
    """The causal LM stored as a delta in ``path``: its base loaded with the ``kvpop`` attention in ``dtype`` on
    ``device``, the stored tensors put in place, eval mode. The config is the student's own."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    meta = json.loads((path / DELTA_CONFIG).read_text())
    base = (path / meta["base_model"]).resolve()
    if not (base / _FULL).is_file():
        raise FileNotFoundError(f"{path} is stored as a weight delta of {base}, which has no {_FULL}; restore that "
                                f"base model (model_delta.json names it) to load this student")
    if _sha256(base / _FULL) != meta["base_sha256"]:
        raise ValueError(f"{path} is a weight delta of {base}, but that base's {_FULL} changed since the delta was "
                         f"written (SHA-256 differs); use the base it was made from")
    config = AutoConfig.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(base, config=config, attn_implementation="kvpop", dtype=dtype)
    delta = load_file(path / DELTA_WEIGHTS)
    state = model.state_dict()
    missing = sorted(set(delta) - set(state))
    if missing:
        raise ValueError(f"{path}: the delta holds tensors the model lacks: {missing[:4]}")
    with torch.no_grad():
        for name, value in delta.items():
            if state[name].shape != value.shape:
                raise ValueError(f"{path}: tensor {name} has shape {tuple(value.shape)} in the delta, "
                                 f"{tuple(state[name].shape)} in the model")
            state[name].copy_(value.to(state[name].dtype))
    return model.to(device).eval()
