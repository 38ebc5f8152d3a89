"""GPU check of the FlexAttention chunk path: tiny models on CUDA, flex (compiled) vs dense-mask logits.

    python benchmarks/flex_chunk_gpu_check.py [--out results.json] [--budget-s 180]

Checks, per arch and dtype: whole-prompt and mixed-size chunked prefill, and left-padded generate with
prefill_chunk_size, flex vs dense (and vs fp32 CPU dense); each variant of the chunk cutoff on CUDA
(``Backends._chunk_cutoff``: blocked, and the torch / wavelet / Triton running top-k sweeps) vs the plain
reference on random plans; then, time permitting, one larger chunk (timing, peak memory).
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import torch

from kvpop_lab.tiny_models import distinct_ids, tiny_model  # noqa: E402

from kvpop_hf import KVpopCache, UntrainedScorerWarning  # noqa: E402
from kvpop_hf.compat import with_cache  # noqa: E402
from kvpop_hf.ops.chunk_attention import flex_chunk_attention as _flex_chunk_attention  # noqa: E402
from kvpop_hf.ops.flex_mask import chunk_cutoff, chunk_cutoff_reference  # noqa: E402
from kvpop_hf.layer import ChunkPlan  # noqa: E402

warnings.filterwarnings("ignore", category=UntrainedScorerWarning)  # random mlstm weights on purpose: dense vs flex

T0 = time.time()
RESULTS: dict = {"torch": torch.__version__, "checks": []}


def log(**kw):
    kw["t"] = round(time.time() - T0, 1)
    RESULTS["checks"].append(kw)
    print(json.dumps(kw), flush=True)


def run_chunks(model, ids, cache, sizes):
    out, i = [], 0
    with torch.no_grad():
        while i < ids.shape[1]:
            for n in sizes:
                if i >= ids.shape[1]:
                    break
                out.append(model(ids[:, i:i + n], **with_cache(model, cache)).logits)
                i += n
    return torch.cat(out, 1).float()


def compare(name, a, b, ref_cpu=None):
    d = (a - b).abs().max().item()
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    rec = dict(check=name, max_abs_flex_vs_dense=d, argmax_agree=agree)
    if ref_cpu is not None:
        rec["max_abs_flex_vs_cpu_fp32"] = (a.cpu() - ref_cpu).abs().max().item()
    log(**rec)
    return d


CUTOFF_VARIANTS = ("blocked", "torch", "wavelet", "triton")


def cutoff_checks(dev):
    g = torch.Generator().manual_seed(0)
    bad = dict.fromkeys(CUTOFF_VARIANTS, 0)
    for trial in range(20):
        b, h = 2, 4
        n_old, L = int(torch.randint(0, 300, (1,), generator=g)), int(torch.randint(1, 300, (1,), generator=g))
        s, w, k = trial % 4, 1 + trial % 7 * 9, [0, 1, 7, 64][trial % 4]
        C = n_old + L
        seen = n_old + 50
        pos = torch.full((b, h, C), -1, dtype=torch.long)
        for bi in range(b):
            for hi in range(h):
                pos[bi, hi, :n_old] = torch.randperm(seen, generator=g)[:n_old]
        qpos = (seen + torch.arange(L)).expand(b, L).clone()
        qpos[1, : L // 3] = -1  # left padding in row 1
        qpos[1, L // 3:] = seen + torch.arange(L - L // 3)
        pos[:, :, n_old:] = qpos[:, None]
        order = torch.stack([torch.randperm(C, generator=g) for _ in range(b * h)]).view(b, h, C)
        args = [x.to(dev) for x in (pos, order, qpos)] + [s, w, k]
        ref = chunk_cutoff_reference(*args)
        for variant in CUTOFF_VARIANTS:
            bad[variant] += int(not torch.equal(chunk_cutoff(*args, backend=variant), ref))
    for variant in CUTOFF_VARIANTS:
        log(check=f"cutoff_{variant}_vs_reference", trials=20, mismatches=bad[variant])


def model_checks(dev, archs=("qwen3", "llama"), dtypes=("float32", "bfloat16", "float16")):
    cpu_ref = {}
    for arch in archs:
        for dtype in [getattr(torch, name) for name in dtypes]:
            model = tiny_model(arch).to(dev, dtype)
            ids = distinct_ids(2, 200, seed=3).to(dev)
            kw = dict(sinks=4, window=24, topk=40, scorer="mlstm" if arch == "llama" else "knorm", log_gamma=-0.2,
                      decay_step=16)
            for feed_name, sizes in (("whole", (200,)), ("chunks", (37, 1, 64, 5, 93))):
                outs = {}
                for mode in ("dense", "flex"):
                    cache = KVpopCache(model.config, **kw, backends={"chunk_attention": mode})
                    outs[mode] = run_chunks(model, ids, cache, sizes)
                if dtype == torch.float32:
                    cpu_model = tiny_model(arch)
                    cpu_cache = KVpopCache(cpu_model.config, **kw, backends={"chunk_attention": "dense"})
                    cpu_ref[arch, feed_name] = run_chunks(cpu_model, ids.cpu(), cpu_cache, sizes)
                compare(f"{arch}/{str(dtype)[6:]}/{feed_name}", outs["flex"], outs["dense"],
                        cpu_ref.get((arch, feed_name)))
            # left padding + prefill_chunk_size through generate (eager: on CUDA a KVpopCache refuses chunks inside
            # generate's compiled call, kvpop_hf/prefill.py)
            lens = (120, 77, 101)
            width = max(lens)
            pad_ids = torch.zeros(3, width, dtype=torch.long)
            mask = torch.zeros_like(pad_ids)
            for i, n in enumerate(lens):
                pad_ids[i, width - n:] = distinct_ids(1, n, seed=n)[0]
                mask[i, width - n:] = 1
            gen = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                       output_logits=True, prefill_chunk_size=48, disable_compile=True)
            res = {}
            for mode in ("dense", "flex"):
                cache = KVpopCache(model.config, **kw, backends={"chunk_attention": mode})
                res[mode] = model.generate(pad_ids.to(dev), attention_mask=mask.to(dev), **with_cache(model, cache, **gen))
            same_seq = torch.equal(res["flex"].sequences, res["dense"].sequences)
            d = max((a.float() - b.float()).abs().max().item() for a, b in zip(res["flex"].logits, res["dense"].logits))
            log(check=f"{arch}/{str(dtype)[6:]}/left_pad_generate_chunk48", same_sequences=same_seq,
                max_abs_logits_flex_vs_dense=d)


def big_chunk(dev, budget_left):
    if budget_left < 40:
        log(check="big_chunk", skipped=f"only {budget_left:.0f}s left")
        return
    b, hkv, G, d, n_old, L = 1, 8, 4, 128, 4096, 4096
    s, w, k = 4, 512, n_old - 4 - 512
    C = n_old + L
    g = torch.Generator(device=dev).manual_seed(0)
    keys = torch.randn(b, hkv, C, d, device=dev, dtype=torch.bfloat16, generator=g)
    vals = torch.randn(b, hkv, C, d, device=dev, dtype=torch.bfloat16, generator=g)
    q = torch.randn(b, hkv * G, L, d, device=dev, dtype=torch.bfloat16, generator=g)
    seen = 20000
    pos = torch.cat([torch.randperm(seen, device=dev)[:n_old].expand(b, hkv, n_old),
                     (seen + torch.arange(L, device=dev)).expand(b, hkv, L)], -1).contiguous()
    qpos = (seen + torch.arange(L, device=dev)).expand(b, L).contiguous()
    prio = torch.randn(b, hkv, C, device=dev)
    order = prio.argsort(-1, descending=True)
    plan = ChunkPlan(keys, vals, pos, order, qpos, s, w, k)
    out = {}
    for mode in ("flex", "dense"):
        for rep in range(3):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t = time.time()
            if mode == "flex":
                o = _flex_chunk_attention(plan, q, keys, vals, None)
            else:
                vis = plan.visibility()
                qq = q.reshape(b, hkv, G * L, d)
                m = vis[:, :, None].expand(b, hkv, G, L, C).reshape(b, hkv, G * L, C)
                o = torch.nn.functional.scaled_dot_product_attention(qq, keys, vals, attn_mask=m)
                o = o.reshape(b, hkv * G, L, d).transpose(1, 2)
            torch.cuda.synchronize()
            dt = time.time() - t
        out[mode] = o.float()
        log(check=f"big_chunk/{mode}", L=L, C=C, hq=hkv * G, ms=round(dt * 1e3, 2),
            peak_extra_MiB=round((torch.cuda.max_memory_allocated() - base) / 2**20, 1))
    log(check="big_chunk/flex_vs_dense", max_abs=(out["flex"] - out["dense"]).abs().max().item())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget-s", type=float, default=180)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--archs", default="qwen3,llama")
    ap.add_argument("--dtypes", default="float32,bfloat16,float16")
    ap.add_argument("--skip-big", action="store_true")
    args = ap.parse_args()
    dev = torch.device(args.device)
    RESULTS["device"] = torch.cuda.get_device_name() if dev.type == "cuda" else str(dev)
    try:
        def models(d):
            model_checks(d, args.archs.split(","), args.dtypes.split(","))

        for name, fn in (("cutoff_checks", cutoff_checks), ("model_checks", models)):
            try:
                fn(dev)
            except Exception as err:  # keep going: report what broke
                log(check=name, error=repr(err)[:2000])
        try:
            if not args.skip_big:
                big_chunk(dev, args.budget_s - (time.time() - T0))
        except Exception as err:
            log(check="big_chunk", error=repr(err)[:2000])
    finally:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(RESULTS, f, indent=1)


if __name__ == "__main__":
    main()
