"""Whether TRIM-KV (the ``trimkv`` package, 0.1.5) can train and run its gates on the testbed teacher here: builds
``TrimKVQwen3ForCausalLM`` from ``checkpoints/testbed-4k-teacher`` and tries, each on its own, (1) one training step
with the package's own loss (forward KL to the frozen model's logits + the retention hinge at ``memory_size = B``,
its FlexAttention training attention ``rg_attn_flex``, gates trainable, the rest frozen) and (2) greedy generation
with its ``TrimKVCache(memory_size=B)`` on the first exported problem; prints what each step raised. Runs in its own
environment (trimkv pins transformers 4.57.1) and imports nothing of kvpop_hf.

    OMP_NUM_THREADS=1 TRITON_INTERPRET=1 PYTHONPATH=benchmarks /work/peers/trimkv-venv/bin/python \\
        -m kvpop_lab.peers.trimkv_check --problems /work/peers/data/record_4k.jsonl [--device cpu] [--seq-len 512]

The teacher's config is read into ``TrimKVQwen3Config`` for transformers 4.57 (its ``rope_parameters`` ->
``rope_theta = 100000``, ``dtype`` dropped) with ``retention_gate="rg"``, ``global_capacity=False`` (TrimKV's
fixed per-head budget, not DBTrimKV's global one). ``import trimkv`` imports ``flash_attn``, which builds only with
CUDA: on a machine without it a stand-in module that raises when called is registered first (``--no-flash-stub``
turns that off), so the paths that do not use flash-attention can be tried. ``--eager-flex`` trains through
uncompiled FlexAttention instead of the package's ``torch.compile(flex_attention, dynamic=True)``.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
import types
from pathlib import Path


def flash_attn_stand_in() -> None:
    """Register ``flash_attn`` as a module whose two functions raise (transformers' own checks run first)."""
    import transformers.integrations.flash_attention  # noqa: F401  (its flash_attn probe must see the real state)

    def unavailable(*args, **kwargs):
        raise RuntimeError("flash_attn is not installed (it builds only with CUDA)")

    pkg, mod = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.flash_attn_interface")
    mod.flash_attn_varlen_func = mod.flash_attn_with_kvcache = unavailable
    pkg.flash_attn_interface = mod
    sys.modules.setdefault("flash_attn", pkg)
    sys.modules.setdefault("flash_attn.flash_attn_interface", mod)


def build(teacher: Path, budget: int, device: str):
    """The teacher as a ``TrimKVQwen3ForCausalLM`` with fresh retention gates (float32)."""
    import torch
    from safetensors.torch import load_file
    from trimkv.models.qwen3 import TrimKVQwen3ForCausalLM
    from trimkv.models.qwen3.configuration_trimkv_qwen3 import TrimKVQwen3Config

    cfg = json.loads((teacher / "config.json").read_text())
    cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    cfg.pop("dtype", None)
    cfg.update(memory_size=budget, retention_gate="rg", global_capacity=False, base_loss="fwkl",
               attn_impl="rg_attn_flex")
    config = TrimKVQwen3Config(**cfg)
    config.rg_dropout = 0.0
    config._attn_implementation = "sdpa"
    model = TrimKVQwen3ForCausalLM(config)
    weights = {k: v.float() for k, v in load_file(teacher / "model.safetensors").items()}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or any("retention_gate" not in k for k in missing):
        raise ValueError(f"teacher weights do not fit: missing {missing}, unexpected {unexpected}")
    for name, p in model.named_parameters():
        p.requires_grad = "retention_gate" in name
    return model.to(device), torch


def train_step(model, torch, ids: list[int], seq_len: int) -> str:
    x = torch.tensor([ids[:seq_len]], device=next(model.parameters()).device)
    labels = x.clone()
    labels[:, : seq_len // 2] = -100
    model.eval()
    with torch.no_grad():
        base = model(x, vanilla_forward=True, use_cache=False).logits
    model.train()
    model.config._attn_implementation = "flex_attention"  # the training attention takes a BlockMask
    try:
        out = model(x, labels=labels, base_logits=base, use_cache=False)
        out.loss.backward()
    finally:
        model.config._attn_implementation = "sdpa"
        model.eval()
    return f"loss {out.loss.item():.4f} (retention {out.retention_loss.item():.4f})"


def generate(model, torch, row: dict, budget: int) -> str:
    from trimkv.cache_utils import TrimKVCache

    dev = next(model.parameters()).device
    ids = torch.tensor([row["prompt_ids"]], device=dev)
    cache = TrimKVCache(memory_size=budget, buffer_size=1, device=str(dev))
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=row["max_new_tokens"],
                             do_sample=False, eos_token_id=row["eos_token_id"], pad_token_id=row["pad_token_id"],
                             past_key_values=cache)
    return f"{out.shape[1] - ids.shape[1]} tokens, {cache.get_cache_length(0)} entries per head at the end"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--problems", required=True)
    ap.add_argument("--teacher", default="checkpoints/testbed-4k-teacher", type=Path)
    ap.add_argument("--compression", default="0.88")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens of the training step (the first of the prompt)")
    ap.add_argument("--no-flash-stub", action="store_true")
    ap.add_argument("--eager-flex", action="store_true",
                    help="train with FlexAttention uncompiled (the package compiles it with dynamic shapes)")
    args = ap.parse_args(argv)
    row = json.loads(Path(args.problems).read_text().splitlines()[0])
    budget = row["budgets"][args.compression]
    if not args.no_flash_stub:
        flash_attn_stand_in()
    model, torch = build(args.teacher, budget, args.device)
    if args.eager_flex:
        import trimkv.attn.flex_attn as flex
        from torch.nn.attention.flex_attention import flex_attention

        flex.flex_attention_compiled = flex_attention
    failed = 0
    for name, step in (("train step", lambda: train_step(model, torch, row["prompt_ids"], args.seq_len)),
                       ("generate", lambda: generate(model, torch, row, budget))):
        try:
            print(f"{name}: ok, {step()}", flush=True)
        except Exception as err:  # report each step's failure and go on to the next
            failed += 1
            where = traceback.extract_tb(err.__traceback__)[-1]
            first = str(err).strip().splitlines()[0]
            print(f"{name}: {type(err).__name__}: {first} (at {Path(where.filename).name}:{where.lineno})")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
