"""FlexAttention diagnostic for the training passes: where do the sparse forward and the target pass spend
their time, and which variant fixes it.

    # GPU (one H200, < 150 s): Qwen3-0.6B attention shapes, bf16, S = 4096 and 16384
    python3 benchmarks/gpu/flex_diag.py --out $OUT/flex_diag
    # CPU smoke test (flex runs eagerly, no peak memory)
    python3 benchmarks/gpu/flex_diag.py --device cpu --seq-lens 256 --heads 4 --kv-heads 2 --head-dim 32 \\
        --window 16 --warmup 1 --repeats 2 --out /tmp/flex_diag_cpu

Cases per S (q ``[1, H, S, d]``, k/v ``[1, Hkv, S, d]``, random priorities -> running top-k, budget S/8):

  calib   compiled flex causal forward (no score_mod, analytic causal block mask, no LSE) and dense SDPA;
  sparse  block-mask build alone (analytic = library default, and the generic tile-by-tile ``tiled_block_mask``),
          the flex kernel alone with a prebuilt mask, the whole ``sparse_attention``;
  target  block-mask build alone (analytic, and tiled), the flex kernel alone with prebuilt inputs and mask,
          the whole ``future_attention_target(backend="flex")``; in bf16 and in fp32 (ieee, and tf32 via
          ``kernel_options``);
  variant candidate fixes/attributions: kernel_options BLOCK_M/BLOCK_N, no full blocks (every block partial),
          an int64 mask_mod, a causal-only mask_mod on the sparse block structure, target without score_mod,
          target dummy value dims.

Each case: warmup calls (compile), one call for peak memory (CUDA ``max_memory_allocated`` minus the allocation
before it), then repeats timed with CUDA events (median). New dynamo graphs are counted during warmup and during the
timed calls: a non-zero "graphs timed" means recompiling on every call. Cases run in priority order under a
wall-clock budget (``--budget-s``); what does not fit is reported as skipped. Every case is guarded.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]

from kvpop_lab.utils.provenance import git_commit, versions  # noqa: E402
from kvpop_lab.utils.timing import compiled_graphs, fmt, free, measure, quantiles, sync  # noqa: E402

warnings.filterwarnings("ignore", message=r".*return_lse.*")
warnings.filterwarnings("ignore", message=r".*flex_attention called without torch.compile.*")
T0 = time.perf_counter()


def recompile_counters() -> str:
    try:
        from torch._dynamo.utils import counters
        keys = {k: dict(v) for k, v in counters.items() if k in ("recompiles", "frames", "stats", "graph_break")}
        return str(keys)
    except Exception as err:  # noqa: BLE001
        return f"unavailable ({err})"


class Diag:
    def __init__(self, args, device):
        self.args, self.device = args, device
        self.cuda = device.type == "cuda"
        self.rows: list[dict] = []
        self.notes: list[str] = []
        print(f"{'case':<52} {'S':>6} {'median ms':>10} {'p10':>8} {'p90':>8} {'peak MiB':>9} {'g warm':>6} "
              f"{'g timed':>7}  status", flush=True)

    def sync(self):
        sync(self.device)

    def free(self):
        free(self.device)

    def over_budget(self) -> bool:
        return time.perf_counter() - T0 > self.args.budget_s

    def note(self, text):
        self.notes.append(text)
        print(f"  * {text}", flush=True)

    def case(self, group, name, S, fn, warmup=None, repeats=None, required=False):
        """Time fn(); returns the last output (or None)."""
        a = self.args
        warmup = a.warmup if warmup is None else warmup
        repeats = a.repeats if repeats is None else repeats
        row = dict(group=group, case=name, S=S, median=math.nan, p10=math.nan, p90=math.nan, peak=math.nan,
                   g_warm=0, g_timed=0, wall=math.nan, status="ok")
        if self.over_budget() and not required:
            row["status"] = f"skipped (wall budget {a.budget_s:.0f} s)"
            self._add(row)
            return None
        t0 = time.perf_counter()
        out = None
        try:
            g0 = compiled_graphs()
            for _ in range(max(warmup, 1)):
                out = None
                t1 = time.perf_counter()
                out = fn()
                self.sync()
                last = time.perf_counter() - t1
            if last > a.slow_s:  # a slow case (e.g. fp32 ieee at 16k): fewer repeats to stay in the budget
                repeats = min(repeats, 3)
            g1 = compiled_graphs()
            out = None
            self.free()
            peak, times, out = measure(fn, self.device, repeats)
            if self.cuda:
                row["peak"] = peak
            g2 = compiled_graphs()
            row.update(g_warm=g1 - g0, g_timed=g2 - g1, **quantiles(times))
        except Exception as err:  # noqa: BLE001
            out = None
            msg = str(err).strip().splitlines()[0][:160] if str(err).strip() else ""
            row["status"] = f"error: {type(err).__name__}: {msg}"
            traceback.print_exc(limit=6)
            err = None
        row["wall"] = time.perf_counter() - t0
        if out is None:
            self.free()
        self._add(row)
        return out

    def _add(self, row):
        self.rows.append(row)
        print(f"{row['case']:<52} {row['S']:>6} {fmt(row['median'], 3):>10} {fmt(row['p10'], 3):>8} "
              f"{fmt(row['p90'], 3):>8} {fmt(row['peak'], 1):>9} {row['g_warm']:>6} {row['g_timed']:>7}  "
              f"{row['status']}", flush=True)

    def get(self, name, S):
        for r in self.rows:
            if r["case"] == name and r["S"] == S and r["status"] == "ok":
                return r
        return None


# ------------------------------------------------------------------------------------------ helpers
def compiled_flex(device):
    from kvpop_hf.ops.flex_compiled import training_flex
    return training_flex(device)


def flex_call(device, q, k, v, lse=False, **kw):
    import torch.nn.attention.flex_attention as _fa
    fn = compiled_flex(device)
    if lse:
        if hasattr(_fa, "AuxRequest"):
            out, aux = fn(q, k, v, return_aux=_fa.AuxRequest(lse=True), **kw)
            return out, aux.lse
        return fn(q, k, v, return_lse=True, **kw)
    return fn(q, k, v, **kw)


def causal_block_mask(S, device, block=128):
    from kvpop_hf.ops.flex_mask import block_mask_from_flags
    nb = -(-S // block)
    i = torch.arange(nb, device=device)
    q0, k0 = i[:, None] * block, i[None, :] * block
    q1, k1 = (q0 + block).clamp_max(S) - 1, (k0 + block).clamp_max(S) - 1
    any_ = k0 <= q1
    full = (k1 <= q0) & (q1 - q0 == block - 1) & (k1 - k0 == block - 1)

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    return block_mask_from_flags((any_ & ~full)[None, None], full[None, None], S, S, causal, block)


def no_full(bm, mask_mod=None):
    """The same BlockMask with full blocks folded into the partial ones (mask_mod evaluated everywhere)."""
    from kvpop_hf.ops.flex_mask import block_mask_from_flags
    S_q, S_kv = bm.seq_lengths
    dense = bm.to_dense()  # [b, H, Qb, Kb] 0/1 (partial + full)
    return block_mask_from_flags(dense > 0, torch.zeros_like(dense, dtype=torch.bool), S_q, S_kv,
                                 mask_mod or bm.mask_mod, bm.BLOCK_SIZE[0])


def same_block_mask(a, b) -> bool:
    for f in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        x, y = getattr(a, f), getattr(b, f)
        if (x is None) != (y is None):
            return False
        if x is None:
            continue
        if f.endswith("indices"):  # only the live prefix of each row is meaningful
            num = getattr(a, "kv_num_blocks" if f == "kv_indices" else "full_kv_num_blocks")
            live = torch.arange(x.shape[-1], device=x.device) < num[..., None]
            if not torch.equal(torch.where(live, x, -1), torch.where(live, y, -1)):
                return False
        elif not torch.equal(x, y):
            return False
    return True


# ------------------------------------------------------------------------------------------ sections
def core_section(d: Diag, S: int, dtype, state: dict):
    import torch.nn.functional as F

    from kvpop_hf.ops.flex_mask import tiled_block_mask
    from kvpop_hf.ops.running_topk import running_topk
    from kvpop_hf.ops.sparse_attention import sparse_attention, sparse_attention_block_mask
    from kvpop_hf.ops.targets import (_expand_kv, _flex_log_sum, _prep_lse, future_attention_target,
                                           future_block_mask_for, future_mask_mod)

    a, dev = d.args, d.device
    H, Hkv, hd, s, w = a.heads, a.kv_heads, a.head_dim, a.sinks, a.window
    groups = H // Hkv
    topk = max(1, int(S // a.compression) - s - w)
    gen = torch.Generator(device="cpu").manual_seed(a.seed + S)
    q = torch.randn(1, H, S, hd, generator=gen).to(dev, dtype)
    k = torch.randn(1, Hkv, S, hd, generator=gen).to(dev, dtype)
    v = torch.randn(1, Hkv, S, hd, generator=gen).to(dev, dtype)
    prio = torch.randn(1, Hkv, S, generator=gen).to(dev)
    plan = running_topk(prio, s, w, topk, backend="triton" if d.cuda else "torch")
    d.note(f"S={S}: topk {topk}, sinks {s}, window {w}, {groups} query heads per KV head")
    st = dict(q=q, k=k, v=v, plan=plan, topk=topk)
    state[S] = st

    with torch.no_grad():
        # calibration
        cbm = causal_block_mask(S, dev)
        d.case("calib", "calib flex causal fwd (compiled, no score_mod, no lse)", S,
               lambda: flex_call(dev, q, k, v, block_mask=cbm, enable_gqa=True), required=True)
        d.case("calib", "calib dense sdpa causal fwd", S,
               lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))

        # sparse forward
        d.case("sparse", "sparse block-mask build (analytic, default)", S,
               lambda: sparse_attention_block_mask(plan, s, w, groups, method="analytic"), required=True)
        d.case("sparse", "sparse block-mask build (old tiled)", S,
               lambda: sparse_attention_block_mask(plan, s, w, groups, method="tiled"))
        bm = sparse_attention_block_mask(plan, s, w, groups, method="analytic")
        st["bm"] = bm
        try:
            same = same_block_mask(bm, sparse_attention_block_mask(plan, s, w, groups, method="tiled"))
            d.note(f"S={S}: sparse block mask analytic == tiled: {same}")
            dens = bm.kv_num_blocks.float().sum().item() + (bm.full_kv_num_blocks.float().sum().item()
                                                            if bm.full_kv_num_blocks is not None else 0)
            nb = bm.kv_num_blocks.shape[-1]
            d.note(f"S={S}: sparse mask: {bm.kv_num_blocks.float().mean().item():.1f} partial + "
                   f"{bm.full_kv_num_blocks.float().mean().item():.1f} full kv blocks per q block "
                   f"(causal half = {(nb + 1) / 2:.1f}); live fraction of causal {dens / (H * nb * (nb + 1) / 2):.3f}")
        except Exception as err:  # noqa: BLE001
            d.note(f"S={S}: block mask comparison failed: {type(err).__name__}: {err}")
        res = d.case("sparse", "sparse flex kernel alone (prebuilt mask)", S,
                     lambda: sparse_attention(q, k, v, plan, s, w, block_mask=bm), required=True)
        d.case("sparse", "sparse_attention whole (build + kernel)", S,
               lambda: sparse_attention(q, k, v, plan, s, w), required=True)
        lse = res[1].detach() if res is not None else None
        res = None
        if lse is None:
            from kvpop_hf.ops.targets import dense_causal_lse
            lse = dense_causal_lse(q, k)
            d.note(f"S={S}: sparse kernel failed; target uses the dense LSE")
        st["lse"] = lse

        # target pass
        d.case("target", "target block-mask build (analytic, default)", S,
               lambda: future_block_mask_for(S, w, dev), required=True)
        fm = future_mask_mod(w)
        d.case("target", "target block-mask build (old tiled)", S,
               lambda: tiled_block_mask(fm, 1, 1, S, S, 1, fm, dev))
        tbm = future_block_mask_for(S, w, dev)
        st["tbm"] = tbm
        sc = hd ** -0.5
        lse_f = _prep_lse(lse).contiguous()
        st["lse_f"] = lse_f
        for name, dt in (("bf16", dtype), ("fp32", torch.float32)):
            qf = q.to(dt).contiguous()
            kf = _expand_kv(k.to(dt), H).contiguous()
            st[f"qf_{name}"], st[f"kf_{name}"] = qf, kf
            out = d.case("target", f"target flex kernel alone {name} (prebuilt)", S,
                         lambda: _flex_log_sum(qf, kf, lse_f, w, sc, block_mask=tbm), required=(name == "bf16"))
            if name == "bf16" and out is not None:
                st["log_sum_bf16"] = out
            if name == "fp32":
                d.case("target", "target flex kernel alone fp32 + tf32 kernel_options", S,
                       lambda: _flex_log_sum(qf, kf, lse_f, w, sc, block_mask=tbm,
                                             kernel_options={"FLOAT32_PRECISION": "'tf32'"}))
            qx, kx = q.to(dt), k.to(dt)
            r = d.case("target", f"future_attention_target whole {name}", S,
                       lambda: future_attention_target(qx, kx, lse, w, backend="flex"), required=(name == "bf16"))
            if r is not None:
                try:
                    ref = future_attention_target(q.float(), k.float(), lse, w, backend="chunked", chunk=256)
                    d.note(f"S={S}: |target flex {name} - chunked fp32| max {(r - ref).abs().max().item():.3e}, "
                           f"mean {(r - ref).abs().mean().item():.3e} (log space)")
                    ref = None
                except Exception as err:  # noqa: BLE001
                    d.note(f"S={S}: chunked reference failed: {type(err).__name__}: {err}")
            r = None
            d.free()


def variant_section(d: Diag, S: int, dtype, state: dict):
    from kvpop_hf.ops.sparse_attention import sparse_attention, sparse_mask_mods
    from kvpop_hf.ops.targets import _flex_log_sum

    st = state.get(S)
    if st is None:
        return
    a, dev = d.args, d.device
    H, Hkv, s, w = a.heads, a.kv_heads, a.sinks, a.window
    groups = H // Hkv
    q, k, v, plan, bm, tbm = st["q"], st["k"], st["v"], st["plan"], st["bm"], st["tbm"]
    lse_f, qf, kf = st["lse_f"], st["qf_bf16"], st["kf_bf16"]
    sc = a.head_dim ** -0.5
    blocks = [tuple(int(x) for x in b.split("x")) for b in a.block_variants.split(",") if b]
    with torch.no_grad():
        for bm_, bn_ in blocks:
            ko = {"BLOCK_M": bm_, "BLOCK_N": bn_}
            d.case("variant", f"sparse kernel BLOCK_M={bm_} BLOCK_N={bn_}", S,
                   lambda: sparse_attention(q, k, v, plan, s, w, block_mask=bm, kernel_options=ko))
            d.case("variant", f"target kernel bf16 BLOCK_M={bm_} BLOCK_N={bn_}", S,
                   lambda: _flex_log_sum(qf, kf, lse_f, w, sc, block_mask=tbm, kernel_options=ko))
        # attribution: mask_mod cost and block structure
        rank64, cut64 = plan.rank, plan.cutoff

        def old_mask_mod(bi, h, q_idx, kv_idx):  # the same mask read through int64 rank/cutoff
            hk = h // groups
            recent = (kv_idx <= q_idx) & ((kv_idx < s) | (q_idx - kv_idx < w))
            kept = (kv_idx >= s) & (kv_idx <= q_idx - w) & (rank64[bi, hk, kv_idx] <= cut64[bi, hk, q_idx])
            return recent | kept

        def causal_only(bi, h, q_idx, kv_idx):
            return kv_idx <= q_idx

        from kvpop_hf.ops.flex_mask import block_mask_from_flags
        dense = bm.to_dense()
        full = torch.zeros_like(dense, dtype=torch.bool)
        if bm.full_kv_num_blocks is not None:
            fr = torch.arange(dense.shape[-1], device=dev) < bm.full_kv_num_blocks[..., None]
            full = full.scatter(-1, bm.full_kv_indices.long(), fr)
        part = (dense > 0) & ~full
        bm_old = block_mask_from_flags(part, full, S, S, old_mask_mod)
        bm_causal = block_mask_from_flags(part, full, S, S, causal_only)
        d.case("variant", "sparse kernel, old int64 mask_mod", S,
               lambda: sparse_attention(q, k, v, plan, s, w, block_mask=bm_old))
        d.case("variant", "sparse kernel, causal-only mask_mod, same blocks", S,
               lambda: sparse_attention(q, k, v, plan, s, w, block_mask=bm_causal))
        _, mm = sparse_mask_mods(plan, s, w, groups)
        bm_nf = no_full(bm, mm)
        d.case("variant", "sparse kernel, no full blocks", S,
               lambda: sparse_attention(q, k, v, plan, s, w, block_mask=bm_nf))
        tbm_nf = no_full(tbm)
        d.case("variant", "target kernel bf16, no full blocks", S,
               lambda: _flex_log_sum(qf, kf, lse_f, w, sc, block_mask=tbm_nf))
        zero = torch.zeros_like(lse_f)
        d.case("variant", "target kernel bf16, lse = 0 (same score_mod)", S,
               lambda: _flex_log_sum(qf, kf, zero, w, sc, block_mask=tbm))
        v16 = torch.zeros(1, H, S, 16, dtype=qf.dtype, device=dev)
        d.case("variant", "target kernel bf16, no score_mod (mask only)", S,
               lambda: flex_call(dev, kf, qf, v16, lse=True, block_mask=tbm, scale=sc))
        for vd in (64, 128):
            d.case("variant", f"target kernel bf16, dummy value dim {vd}", S,
                   lambda: _flex_log_sum(qf, kf, lse_f, w, sc, block_mask=tbm, v_dim=vd))


def checks(d: Diag, seq_lens) -> list[str]:
    out = []
    for S in seq_lens:
        b = d.get("sparse_attention whole (build + kernel)", S)
        bk = d.get("sparse flex kernel alone (prebuilt mask)", S)
        c = d.get("future_attention_target whole bf16", S)
        cal = d.get("calib flex causal fwd (compiled, no score_mod, no lse)", S)
        if b and c:
            r = c["median"] / b["median"]
            out.append(f"S={S}: target whole bf16 / sparse whole = {c['median']:.3f} / {b['median']:.3f} ms = "
                       f"{r:.2f}x ({'HOLDS' if r <= 1.5 else 'FAILS'} <= 1.5x)")
        if bk and cal:
            out.append(f"S={S}: sparse kernel alone / calibration causal flex = {bk['median'] / cal['median']:.2f}x")
        ck = d.get("target flex kernel alone bf16 (prebuilt)", S)
        if ck and cal:
            out.append(f"S={S}: target kernel alone bf16 / calibration causal flex = {ck['median'] / cal['median']:.2f}x")
        timed = [r for r in d.rows if r["S"] == S and r["g_timed"] > 0]
        if timed:
            out.append(f"S={S}: RECOMPILES during timed calls: " + ", ".join(f"{r['case']} (+{r['g_timed']})"
                                                                           for r in timed))
    if len(seq_lens) >= 2 and d.cuda:
        s0, s1 = min(seq_lens), max(seq_lens)
        for name in ("sparse block-mask build (analytic, default)", "sparse_attention whole (build + kernel)",
                     "target block-mask build (analytic, default)", "future_attention_target whole bf16",
                     "sparse block-mask build (old tiled)"):
            r0, r1 = d.get(name, s0), d.get(name, s1)
            if r0 and r1 and r0["peak"] > 0 and r1["peak"] > 0:
                e = math.log(r1["peak"] / r0["peak"]) / math.log(s1 / s0)
                out.append(f"peak memory {name}: {r0['peak']:.1f} -> {r1['peak']:.1f} MiB, exponent {e:.2f} "
                           "(O(S) = 1, O(S^2) = 2)")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="bfloat16 (default on CUDA) | float32 (default on CPU)")
    p.add_argument("--seq-lens", default="4096,16384")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--compression", type=float, default=8.0)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--block-variants", default="64x64,128x64,128x128", help="BLOCK_MxBLOCK_N kernel_options variants")
    p.add_argument("--no-variants", action="store_true")
    p.add_argument("--slow-s", type=float, default=0.1, help="cases whose last warmup call took longer: 3 repeats")
    p.add_argument("--budget-s", type=float, default=115.0, help="stop starting optional cases after this wall time")
    p.add_argument("--no-recompile-log", action="store_true", help="do not turn on TORCH_LOGS-style recompile logs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/flex_diag/flex_diag")
    a = p.parse_args(argv)

    device = torch.device(a.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("CUDA not available (use --device cpu)")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, a.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    seq_lens = [int(x) for x in a.seq_lens.split(",") if x]
    if not a.no_recompile_log:
        try:
            torch._logging.set_logs(recompiles=True)
        except Exception as err:  # noqa: BLE001
            print(f"recompile logs unavailable: {err}", flush=True)
    from kvpop_hf.ops.flex_compiled import recompile_limits

    for name, value in recompile_limits(64).items():  # this script's own process
        setattr(torch._dynamo.config, name, value)

    meta = {"command": " ".join(shlex.quote(x) for x in [sys.executable, *sys.argv]),
            "git_commit": git_commit(REPO), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    meta.update(versions("torch", "triton", missing=lambda err: "unavailable"))
    meta["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)"
    meta["dtype"] = str(dtype).replace("torch.", "")
    meta["shapes"] = f"q [1, {a.heads}, S, {a.head_dim}], k/v [1, {a.kv_heads}, S, {a.head_dim}]"
    meta["mask"] = f"sinks {a.sinks}, window {a.window}, budget S/{a.compression:g}, random priorities"
    meta["timing"] = f"warmup {a.warmup}, repeats {a.repeats} (median), CUDA events" if device.type == "cuda" \
        else f"warmup {a.warmup}, repeats {a.repeats} (median), perf_counter"
    print("\n".join(f"{k_}: {v_}" for k_, v_ in meta.items()), flush=True)

    d = Diag(a, device)
    state: dict = {}
    for S in seq_lens:
        try:
            core_section(d, S, dtype, state)
        except Exception as err:  # noqa: BLE001
            traceback.print_exc(limit=6)
            d.note(f"S={S}: core section aborted: {type(err).__name__}: {err}")
            err = None
        d.free()
    if not a.no_variants:
        for S in seq_lens:
            try:
                variant_section(d, S, dtype, state)
            except Exception as err:  # noqa: BLE001
                traceback.print_exc(limit=6)
                d.note(f"S={S}: variant section aborted: {type(err).__name__}: {err}")
                err = None
            d.free()
    state.clear()
    d.note(f"dynamo counters: {recompile_counters()}")
    verdicts = checks(d, seq_lens)
    total = time.perf_counter() - T0
    print(f"\n{'case':<52} {'S':>6} {'median ms':>10} {'peak MiB':>9} {'g warm':>6} {'g timed':>7}  status")
    for r in d.rows:
        print(f"{r['case']:<52} {r['S']:>6} {fmt(r['median'], 3):>10} {fmt(r['peak'], 1):>9} {r['g_warm']:>6} "
              f"{r['g_timed']:>7}  {r['status'][:60]}")
    print("\n" + "\n".join(verdicts) + f"\ntotal wall {total:.1f} s", flush=True)

    md = ["# FlexAttention diagnostic (training passes, per layer)", ""]
    md += [f"- **{k_}**: `{v_}`" if k_ == "command" else f"- **{k_}**: {v_}" for k_, v_ in meta.items()]
    md += [f"- **total wall**: {total:.1f} s", "",
           "Peak: CUDA `max_memory_allocated` minus the allocation before the call (inputs excluded). "
           "`graphs warmup` / `graphs timed`: new dynamo graphs during warmup / during the timed calls "
           "(non-zero timed = recompiling per call).", "",
           "| group | case | S | median ms | p10 ms | p90 ms | peak MiB | graphs warmup | graphs timed | wall s | status |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in d.rows:
        md.append(f"| {r['group']} | {r['case']} | {r['S']} | {fmt(r['median'], 3)} | {fmt(r['p10'], 3)} | "
                  f"{fmt(r['p90'], 3)} | {fmt(r['peak'], 1)} | {r['g_warm']} | {r['g_timed']} | {fmt(r['wall'], 1)} | "
                  f"{r['status']} |")
    md += ["", "## Checks", ""] + [f"- {v_}" for v_ in verdicts]
    md += ["", "## Notes", ""] + [f"- {n}" for n in d.notes]
    outp = Path(a.out)
    outp.parent.mkdir(parents=True, exist_ok=True)
    md_path = outp.with_name(outp.name + ".md")
    md_path.write_text("\n".join(md) + "\n")
    print(f"wrote {md_path}", flush=True)


if __name__ == "__main__":
    main()
