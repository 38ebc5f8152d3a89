"""Grow a trained testbed teacher without changing what it computes: more decoder layers, attention heads and MLP
units, every new part starting with a zero output, so the grown model's logits equal the source's and training puts
the new capacity to use from there (the block expansion of LLaMA Pro, with wider blocks as well).

* Layers: source layer ``i`` is followed by ``extra_i`` copies of itself whose attention ``o_proj`` and MLP
  ``down_proj`` are zero (an identity block on the residual stream); the ``layers - n`` extra layers are spread evenly
  over the ``n`` source layers.
* Heads: query heads ``H0 -> H`` and KV heads ``K0 -> K`` with the group size kept (``H / K == H0 / K0``), so source
  query head ``h`` still reads KV head ``h // (H0 / K0)``; the new heads' q/k/v rows are drawn at random (the config's
  ``initializer_range``), their ``o_proj`` columns are zero.
* MLP: ``intermediate I0 -> I``; the new units' ``gate_proj`` / ``up_proj`` rows are random, their ``down_proj``
  columns zero.

Shapes (Qwen3 layout, ``d`` the head dim, ``D`` the hidden size): ``q_proj [H*d, D]``, ``k_proj`` / ``v_proj
[K*d, D]``, ``o_proj [D, H*d]``, ``gate_proj`` / ``up_proj [I, D]``, ``down_proj [D, I]``; the hidden size, head dim,
norms, embeddings and head are the source's.

CLI: ``python -m kvpop_lab.grow_teacher --src DIR --out DIR [--layers N] [--heads H --kv-heads K]
[--intermediate I] [--seed S]`` writes the grown model, the source's tokenizer and ``grow.json`` (the command).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

__all__ = ["grow", "extra_layers", "main"]

_LAYER_PARAMS = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight"}
_OUTPUTS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")  # [D, in]: the new inputs' columns start at zero


def extra_layers(n: int, layers: int) -> list[int]:
    """How many zero-output copies follow each of ``n`` source layers so that there are ``layers`` in all, spread
    evenly (``[1] * n`` for ``layers == 2 n``)."""
    extra = layers - n
    return [extra * (i + 1) // n - extra * i // n for i in range(n)]


def _check(cfg, layers: int, heads: int, kv_heads: int, intermediate: int) -> None:
    n, h0, k0, i0 = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        raise ValueError("grow: the source has bias terms in its projections; only bias-free layers (Qwen3, Llama) "
                         "can be grown")
    if layers < n:
        raise ValueError(f"grow: --layers {layers} is below the source's {n}; a grown model keeps every layer")
    if heads < h0 or kv_heads < k0:
        raise ValueError(f"grow: --heads {heads} / --kv-heads {kv_heads} are below the source's {h0} / {k0}")
    if heads % kv_heads or heads // kv_heads != h0 // k0:
        raise ValueError(f"grow: --heads {heads} / --kv-heads {kv_heads} change the group size {h0 // k0} of the "
                         f"source's {h0} / {k0} heads; keep heads / kv-heads = {h0 // k0} (e.g. --heads "
                         f"{2 * h0} --kv-heads {2 * k0})")
    if intermediate < i0:
        raise ValueError(f"grow: --intermediate {intermediate} is below the source's {i0}")


@torch.no_grad()
def grow(src: PreTrainedModel, layers: int | None = None, heads: int | None = None, kv_heads: int | None = None,
         intermediate: int | None = None, seed: int = 0) -> PreTrainedModel:
    """The grown copy of ``src`` (a Qwen3- or Llama-layout causal LM; ``None`` keeps the source's size), in the
    source's dtype and on the CPU. Raises ValueError naming the problem for sizes it cannot grow to."""
    cfg0 = src.config
    layers = cfg0.num_hidden_layers if layers is None else layers
    heads = cfg0.num_attention_heads if heads is None else heads
    kv_heads = cfg0.num_key_value_heads if kv_heads is None else kv_heads
    intermediate = cfg0.intermediate_size if intermediate is None else intermediate
    _check(cfg0, layers, heads, kv_heads, intermediate)
    extra = extra_layers(cfg0.num_hidden_layers, layers)
    source_of = [(i, c > 0) for i, e in enumerate(extra) for c in range(1 + e)]  # (source layer, zero-output copy)

    cfg = copy.deepcopy(cfg0)
    cfg.num_hidden_layers, cfg.num_attention_heads = layers, heads
    cfg.num_key_value_heads, cfg.intermediate_size = kv_heads, intermediate
    if getattr(cfg0, "layer_types", None) is not None:
        cfg.layer_types = [cfg0.layer_types[i] for i, _ in source_of]
    torch.manual_seed(seed)
    dst = type(src)(cfg).to(dtype=next(src.parameters()).dtype)  # random init: what the new rows keep

    old = dict(src.named_parameters())
    prefix = "model.layers."
    for name, t in dst.named_parameters():
        if not name.startswith(prefix):
            t.copy_(old[name])  # embeddings, final norm, head: the source's
            continue
        j, rest = name[len(prefix):].split(".", 1)
        if rest not in _LAYER_PARAMS:
            raise ValueError(f"grow: unknown layer parameter {rest!r}; only Qwen3/Llama-layout layers can be grown")
        i, zero_copy = source_of[int(j)]
        s = old[f"{prefix}{i}.{rest}"]
        t[tuple(slice(0, n) for n in s.shape)] = s
        if rest in _OUTPUTS:
            t[:, s.shape[1]:] = 0
            if zero_copy:
                t.zero_()
    return dst.eval()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvpop_lab.grow_teacher", description=__doc__.split("\n\n")[0])
    p.add_argument("--src", required=True, help="the teacher folder to grow (config.json, weights, tokenizer)")
    p.add_argument("--out", required=True, help="folder for the grown teacher")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the source's)")
    p.add_argument("--heads", type=int, default=None, help="query heads (default: the source's)")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (default: the source's)")
    p.add_argument("--intermediate", type=int, default=None, help="MLP units (default: the source's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the new heads' and units' random rows")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not os.path.isfile(os.path.join(args.src, "config.json")):
        raise SystemExit(f"--src {args.src}: no config.json there (expected a saved teacher folder)")
    src = AutoModelForCausalLM.from_pretrained(args.src)
    try:
        dst = grow(src, args.layers, args.heads, args.kv_heads, args.intermediate, args.seed)
    except ValueError as err:
        raise SystemExit(str(err))
    dst.save_pretrained(args.out)
    AutoTokenizer.from_pretrained(args.src).save_pretrained(args.out)
    n0, n1 = (sum(p.numel() for p in m.parameters()) for m in (src, dst))
    record = {"command": "python -m kvpop_lab.grow_teacher " + " ".join(sys.argv[1:] if argv is None else argv),
              "src": args.src, "params": [n0, n1], "layers": dst.config.num_hidden_layers,
              "heads": dst.config.num_attention_heads, "kv_heads": dst.config.num_key_value_heads,
              "intermediate": dst.config.intermediate_size, "seed": args.seed}
    with open(os.path.join(args.out, "grow.json"), "w") as f:
        json.dump(record, f, indent=2)
    print(f"grown {args.src} ({n0 / 1e6:.2f}M params) -> {args.out} ({n1 / 1e6:.2f}M params: "
          f"{record['layers']} layers, {record['heads']} / {record['kv_heads']} heads, "
          f"{record['intermediate']} MLP units)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
