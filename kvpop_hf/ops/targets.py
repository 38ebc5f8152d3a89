"""Future-attention regression targets for KVpop training.

Notation
--------
* ``q``  query states  ``[B, Hq, S, D]``
* ``k``  key states    ``[B, Hkv, S, D]`` (GQA: ``Hq = G * Hkv``; query head ``j``
  belongs to KV head ``j // G``, same convention as HF ``repeat_kv``)
* ``lse`` per-query log-sum-exp of the (scaled) attention scores, ``[B, Hq, S]``,
  natural log.  With the dense causal LSE (:func:`dense_causal_lse`) the
  probabilities below are the exact dense attention probabilities; with the LSE
  of a sparse forward pass they are the paper's approximation.  The formula is
  the same in both cases, only the ``lse`` input differs.

For query ``d`` and key ``t``::

    A[d, t] = exp(scale * q_d . k_t - LSE_d)

Future-attention mass of key ``t`` for query head ``j`` with window ``w >= 1``::

    m_t = (1 / N_t) * sum_{d = t + w}^{S - 1} A[d, t],   N_t = max(1, S - (t + w))

(``m_t = 0`` if there is no such ``d``.)  Target per KV head ``h``:

* ``agg="log_mean"``: ``r[h, t] = log(eps + mean_{j in group h} m_t^{(j)})``
* ``agg="mean_log"``: ``r[h, t] = mean_{j in group h} log(eps + m_t^{(j)})``

``query_mask [B, S]`` (bool, optional; not in the paper) restricts the future queries ``d`` to those marked
True, e.g. the queries whose next token the training loss scores (labels), and ``N_t`` counts only them. On
the testbed the prompt's own queries (filler reading filler) otherwise outweigh the few answer queries that
read the facts and rules (``docs/design.md``, the 4k testbed). An excluded query is given ``LSE = +inf``, so
all its weights are 0 in every backend.

``reduce="max"`` (not in the paper; ``chunked`` backend and the reference only) replaces the mean over
future queries by the largest weight, ``m_t = max_{d >= t + w} A[d, t]``: a token that one later query
reads sharply then ranks as high as one that many queries read (on the testbed the mean undervalues
facts that a single lookup reads; see ``benchmarks/oracle_eviction.py``).

``reduce="p<x>"`` (not in the paper; ``chunked`` backend and the reference only), e.g. ``"p4"``: the power mean
of order ``x > 1`` over future queries, ``m_t = ((1 / N_t) sum_{d >= t + w} A[d, t]^x)^(1 / x)``, which lies
between the mean (``x = 1``) and the max (``x -> inf``): one sharp read counts more than in the mean, yet the
many weak reads still order the tokens that no query reads sharply.

Backends of :func:`future_attention_target`
-------------------------------------------
* ``"flex"``: a *transposed* FlexAttention pass.  Flex queries are the keys
  (expanded to ``Hq`` heads), flex keys are the original queries, the
  ``score_mod`` subtracts ``lse[b, h, kv_idx]`` (the LSE of the original query
  ``d = kv_idx``) and the block mask keeps ``kv_idx >= q_idx + window``.  The
  LSE flex returns for flex-query ``t`` is then ``log sum_{d >= t+w} A[d, t]``.
  On CPU flex runs eagerly; on CUDA it is ``torch.compile``-d (lazily, once).
* ``"chunked"``: the same transposed computation in plain torch over chunks of
  keys, ``O(S * chunk)`` memory per (batch, head).

All maths is float32 regardless of the input dtype.
"""

from __future__ import annotations

import math
import warnings
from typing import Optional

import torch

from .dense_attention import expand_kv
from .flex_compiled import training_flex

__all__ = [
    "dense_causal_lse",
    "future_attention_target_reference",
    "future_attention_target",
]

_AGGS = ("log_mean", "mean_log")
_BACKENDS = ("flex", "chunked")


def reduce_power(reduce) -> float:
    """The order of the power mean a ``reduce`` names: ``"mean"`` 1, ``"max"`` inf, ``"p<x>"`` x (> 1).
    Raises a ValueError naming the accepted values for anything else."""
    if reduce == "mean":
        return 1.0
    if reduce == "max":
        return math.inf
    if isinstance(reduce, str) and reduce.startswith("p"):
        try:
            x = float(reduce[1:])
        except ValueError:
            x = None
        if x is not None and math.isfinite(x) and x > 1:
            return x
    raise ValueError(f"reduce must be 'mean', 'max' or 'p<x>' with a number x > 1 (a power mean, e.g. 'p4'), "
                     f"got {reduce!r}")


# ---------------------------------------------------------------------------
# validation helpers
# ---------------------------------------------------------------------------


def _check_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int, int, int]:
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        raise ValueError("q and k must be torch.Tensors")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, Hq, S, D], got shape {tuple(q.shape)}")
    if k.dim() != 4:
        raise ValueError(f"k must be [B, Hkv, S, D], got shape {tuple(k.shape)}")
    B, Hq, S, D = q.shape
    Bk, Hkv, Sk, Dk = k.shape
    if Bk != B:
        raise ValueError(f"batch mismatch: q has B={B}, k has B={Bk}")
    if Sk != S:
        raise ValueError(f"sequence mismatch: q has S={S}, k has S={Sk}")
    if Dk != D:
        raise ValueError(f"head-dim mismatch: q has D={D}, k has D={Dk}")
    if Hkv < 1 or Hq % Hkv != 0:
        raise ValueError(f"Hq={Hq} must be a positive multiple of Hkv={Hkv}")
    if S < 1 or D < 1:
        raise ValueError(f"empty sequence or head dim: S={S}, D={D}")
    return B, Hq, Hkv, S, D


def _check_common(q, k, lse, window, eps, agg):
    B, Hq, Hkv, S, D = _check_qk(q, k)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}")
    if agg not in _AGGS:
        raise ValueError(f"agg must be one of {_AGGS}, got {agg!r}")
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise ValueError(f"eps must be a positive number, got {eps!r}")
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != (B, Hq, S):
        shape = tuple(lse.shape) if isinstance(lse, torch.Tensor) else type(lse)
        raise ValueError(f"lse must have shape {(B, Hq, S)}, got {shape}")
    return B, Hq, Hkv, S, D


def _scale(scale: Optional[float], D: int) -> float:
    return float(D) ** -0.5 if scale is None else float(scale)


def _expand_kv(k: torch.Tensor, Hq: int) -> torch.Tensor:
    """[B, Hkv, S, D] -> [B, Hq, S, D] (head j uses KV head j // G)."""
    return expand_kv(k, Hq // k.shape[1])


def _prep_lse(lse: torch.Tensor) -> torch.Tensor:
    """float32 LSE; a query with no visible key (LSE = -inf) attends nowhere, so
    map it to +inf => all its A[d, t] become exp(-inf) = 0 instead of NaN/inf."""
    lse = lse.float()
    return torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse)


def _counts(S: int, window: int, device, query_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``N_t`` ``[S]`` (all queries) or ``[B, 1, S]`` (the marked queries ``d >= t + window``), at least 1."""
    if query_mask is None:
        t = torch.arange(S, device=device, dtype=torch.float32)
        return torch.clamp(S - (t + window), min=1.0)
    suffix = query_mask.to(device=device, dtype=torch.float32).flip(-1).cumsum(-1).flip(-1)  # [B, S]: #marked >= d
    later = torch.zeros_like(suffix)
    if window < S:
        later[:, :S - window] = suffix[:, window:]
    return later.clamp(min=1.0)[:, None, :]


def _check_query_mask(query_mask, B: int, S: int) -> None:
    if query_mask is None:
        return
    if not isinstance(query_mask, torch.Tensor) or query_mask.dtype != torch.bool or \
            tuple(query_mask.shape) != (B, S):
        got = (tuple(query_mask.shape), query_mask.dtype) if isinstance(query_mask, torch.Tensor) else type(query_mask)
        raise ValueError(f"query_mask must be a bool tensor of shape {(B, S)}, got {got}")


def _mask_lse(lse_f: torch.Tensor, query_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Excluded queries get LSE = +inf: all their attention weights become exactly 0."""
    if query_mask is None:
        return lse_f
    return torch.where(query_mask[:, None, :].to(lse_f.device), lse_f, torch.full_like(lse_f, math.inf))


def _aggregate(log_sum: torch.Tensor, Hkv: int, window: int, eps: float, agg: str,
               power: float = 1.0, query_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """log_sum [B, Hq, S] = log sum_{d>=t+w} A[d,t] (-inf if empty) -> r [B, Hkv, S]. ``power`` x: the input is
    ``(1/x) log sum A^x`` and is divided by ``N_t^(1/x)``; ``inf``: it is already the per-key statistic
    (``log max``), not divided by the query count."""
    B, Hq, S = log_sum.shape
    G = Hq // Hkv
    log_sum = log_sum.float()
    # Guard: anything that is not a finite number or -inf (NaN) is treated as empty.
    log_sum = torch.where(torch.isnan(log_sum), torch.full_like(log_sum, -math.inf), log_sum)
    log_m = log_sum - torch.log(_counts(S, window, log_sum.device, query_mask)) / power if math.isfinite(power) \
        else log_sum  # [B, Hq, S]
    log_m = log_m.view(B, Hkv, G, S)
    log_eps = torch.full((), math.log(eps), dtype=torch.float32, device=log_m.device)
    if agg == "log_mean":
        # log(eps + mean_j m_j) = logaddexp(log eps, logsumexp_j log m_j - log G)
        lm = torch.logsumexp(log_m, dim=2) - math.log(G)
        # logsumexp over all -inf yields -inf in torch; make it explicit anyway
        lm = torch.where(torch.isnan(lm), torch.full_like(lm, -math.inf), lm)
        r = torch.logaddexp(log_eps.expand_as(lm), lm)
    else:
        r = torch.logaddexp(log_eps.expand_as(log_m), log_m).mean(dim=2)
    return r.contiguous()


# ---------------------------------------------------------------------------
# dense LSE
# ---------------------------------------------------------------------------


def dense_causal_lse(q: torch.Tensor, k: torch.Tensor, scale: Optional[float] = None,
                     chunk: int = 1024, softcap: Optional[float] = None,
                     sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Exact dense causal LSE ``[B, Hq, S]`` (float32, natural log).

    ``LSE_d = logsumexp_{t <= d} scale * q_d . k_t``, computed over query chunks
    of size ``chunk`` so that at most a ``chunk x S`` slice of the score map
    exists at a time. ``softcap``: logits ``softcap * tanh(logit / softcap)`` (Gemma2); ``sinks [Hq]``: one
    learned logit per head joins the sum (GPT-OSS), as the model's attention computes them.
    """
    B, Hq, Hkv, S, D = _check_qk(q, k)
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
    sc = _scale(scale, D)
    qf = q.float()
    kf = _expand_kv(k.float(), Hq)
    out = torch.empty(B, Hq, S, dtype=torch.float32, device=q.device)
    for d0 in range(0, S, chunk):
        d1 = min(S, d0 + chunk)
        s = _softcap(torch.matmul(qf[:, :, d0:d1], kf[:, :, :d1].transpose(-1, -2)) * sc, softcap)  # [B,Hq,c,d1]
        d_idx = torch.arange(d0, d1, device=q.device)[:, None]
        t_idx = torch.arange(d1, device=q.device)[None, :]
        s = s.masked_fill(t_idx > d_idx, -math.inf)
        out[:, :, d0:d1] = torch.logsumexp(s, dim=-1)
    if sinks is not None:
        out = torch.logaddexp(out, sinks.float().to(out.device).view(1, Hq, 1))
    return out


def _softcap(scores: torch.Tensor, softcap: Optional[float]) -> torch.Tensor:
    """Attention logit softcapping ``softcap * tanh(scores / softcap)`` (None or 0: unchanged)."""
    return scores if not softcap else torch.tanh(scores / softcap) * softcap


# ---------------------------------------------------------------------------
# reference (materialised)
# ---------------------------------------------------------------------------


def future_attention_target_reference(q, k, lse, window, eps=1e-6, agg="log_mean",
                                      scale=None, reduce: str = "mean", query_mask=None,
                                      softcap: Optional[float] = None) -> torch.Tensor:
    """Obviously-correct oracle: materialises the full ``S x S`` map of
    ``A[d, t] = exp(scale q_d.k_t - LSE_d)``, sums it over ``d >= t + window`` (and marked by ``query_mask``),
    divides by ``N_t`` and aggregates per KV head.  Returns float32 ``[B, Hkv, S]``.
    """
    B, Hq, Hkv, S, D = _check_common(q, k, lse, window, eps, agg)
    _check_query_mask(query_mask, B, S)
    sc = _scale(scale, D)
    qf = q.float()
    kf = _expand_kv(k.float(), Hq)
    scores = _softcap(torch.matmul(qf, kf.transpose(-1, -2)) * sc, softcap)  # [B, Hq, S(d), S(t)]
    P = torch.exp(scores - _prep_lse(lse)[..., :, None])
    d_idx = torch.arange(S, device=q.device)[:, None]
    t_idx = torch.arange(S, device=q.device)[None, :]
    P = torch.where(d_idx >= t_idx + window, P, torch.zeros_like(P))
    if query_mask is not None:
        P = P * query_mask[:, None, :, None].to(P.dtype)
    power = reduce_power(reduce)
    if reduce == "max":
        m = P.amax(dim=2)  # [B, Hq, S(t)]
    else:
        if query_mask is None:
            n = torch.clamp(S - (torch.arange(S, device=q.device) + window), min=1).float()
        else:  # marked queries at d >= t + window, counted one by one
            n = torch.stack([torch.stack([query_mask[b, t + window:].sum() for t in range(S)])
                             for b in range(B)]).clamp(min=1).float()[:, None, :]
        m = (P.pow(power).sum(dim=2) / n).pow(1.0 / power)  # [B, Hq, S(t)]
    G = Hq // Hkv
    m = m.view(B, Hkv, G, S)
    if agg == "log_mean":
        r = torch.log(eps + m.mean(dim=2))
    else:
        r = torch.log(eps + m).mean(dim=2)
    return r


# ---------------------------------------------------------------------------
# transposed passes
# ---------------------------------------------------------------------------

def future_mask_mod(window: int):
    """The transposed target mask: flex ``q_idx`` = original key ``t``, flex ``kv_idx`` = original query ``d``."""
    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx >= q_idx + window
    return mask_mod


def future_block_mask_for(S: int, window: int, device):
    """``BlockMask`` of :func:`future_mask_mod`, shared by all rows/heads, built analytically from block
    indices (``O((S/128)^2)`` ints; :func:`kvpop_hf.ops.block_masks.future_block_mask`)."""
    from .block_masks import future_block_mask

    return future_block_mask(S, window, future_mask_mod(window), device)


def _flex_log_sum(qf, kf_exp, lse_f, window: int, sc: float, block_mask=None, kernel_options=None,
                  v_dim: int = 16, softcap: Optional[float] = None) -> torch.Tensor:
    """Transposed flex pass.  Returns ``log sum_{d >= t+w} A[d, t]`` [B, Hq, S].

    ``block_mask``: a prebuilt :func:`future_block_mask_for` (built here if None); ``kernel_options`` go to
    FlexAttention; ``v_dim``: head dim of the discarded dummy value."""
    import torch.nn.attention.flex_attention as _fa

    B, Hq, S, D = qf.shape
    device = qf.device

    def score_mod(score, b, h, q_idx, kv_idx):
        return score - lse_f[b, h, kv_idx]

    if softcap:
        def score_mod(score, b, h, q_idx, kv_idx):  # noqa: F811 - the softcapped logits of the model
            return torch.tanh(score / softcap) * softcap - lse_f[b, h, kv_idx]

    if block_mask is None:
        block_mask = future_block_mask_for(S, window, device)
    kw = {"kernel_options": kernel_options} if kernel_options else {}
    # the output is discarded: a tiny dummy value tensor (must share S with keys)
    v = torch.zeros(B, Hq, S, v_dim, dtype=qf.dtype, device=device)
    fn = training_flex(device)  # eager on CPU, compiled on CUDA (shared with the sparse forward)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile" / return_lse deprecation
        if hasattr(_fa, "AuxRequest"):
            _, aux = fn(kf_exp, qf, v, score_mod=score_mod, block_mask=block_mask, scale=sc,
                        return_aux=_fa.AuxRequest(lse=True), **kw)
            log_sum = aux.lse
        else:
            _, log_sum = fn(kf_exp, qf, v, score_mod=score_mod, block_mask=block_mask, scale=sc,
                            return_lse=True, **kw)
    log_sum = log_sum.float()
    # Fully-masked rows (t + w > S - 1): torch 2.13 eager flex returns -inf here;
    # enforce it regardless of version/backend (some kernels return 0 or finite junk).
    t = torch.arange(S, device=device)
    empty = (t + window > S - 1)
    log_sum = torch.where(empty, torch.full_like(log_sum, -math.inf), log_sum)
    return log_sum


def _chunked_log_sum(qf, kf_exp, lse_f, window: int, sc: float, chunk: int, reduce: str = "mean",
                     softcap: Optional[float] = None) -> torch.Tensor:
    """Plain-torch transposed pass over key chunks: ``[B, Hq, chunk, S]`` at a time. Returns
    ``log sum_{d >= t+w} A[d, t]`` (``reduce="max"``: ``log max``; ``"p<x>"``: ``(1/x) log sum A^x``)
    ``[B, Hq, S]``."""
    power = reduce_power(reduce)
    B, Hq, S, D = qf.shape
    device = qf.device
    out = torch.full((B, Hq, S), -math.inf, dtype=torch.float32, device=device)
    last_t = S - 1 - window  # keys beyond this have no future query
    if last_t < 0:
        return out
    for t0 in range(0, last_t + 1, chunk):
        t1 = min(last_t + 1, t0 + chunk)
        d0 = t0 + window  # smallest query any key of the chunk can see
        s = _softcap(torch.matmul(kf_exp[:, :, t0:t1], qf[:, :, d0:].transpose(-1, -2)) * sc, softcap)  # [B,Hq,c,S-d0]
        s = s - lse_f[:, :, None, d0:]
        t_idx = torch.arange(t0, t1, device=device)[:, None]
        d_idx = torch.arange(d0, S, device=device)[None, :]
        s = s.masked_fill(d_idx < t_idx + window, -math.inf)
        if reduce == "max":
            out[:, :, t0:t1] = s.amax(dim=-1)
        else:  # log (sum A^x)^(1/x); x = 1 for the mean
            out[:, :, t0:t1] = torch.logsumexp(s * power, dim=-1) / power if power != 1 else torch.logsumexp(s, -1)
    return out


def future_attention_target(q, k, lse, window, eps=1e-6, agg="log_mean", scale=None,
                            backend="flex", chunk: int = 512, reduce: str = "mean",
                            query_mask: Optional[torch.Tensor] = None,
                            softcap: Optional[float] = None) -> torch.Tensor:
    """Future-attention target ``r`` ``[B, Hkv, S]`` (float32) via a transposed pass.

    ``softcap``: the model caps its attention logits (Gemma2), ``A[d, t] = exp(c tanh(scale q_d.k_t / c) - LSE_d)``;
    learned sinks (GPT-OSS) enter through ``lse`` alone (the softmax denominator includes them).

    See the module docstring for the definition.  ``backend="flex"`` uses
    FlexAttention with swapped roles (keys as queries); ``backend="chunked"``
    does the same in plain torch over ``chunk`` keys at a time.  Keys with no
    future query (``t + window > S - 1``, or none marked in ``query_mask [B, S]``) get ``log(eps)``.
    """
    B, Hq, Hkv, S, D = _check_common(q, k, lse, window, eps, agg)
    _check_query_mask(query_mask, B, S)
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    power = reduce_power(reduce)
    if reduce != "mean" and backend != "chunked":
        raise ValueError(f"reduce={reduce!r} is implemented by backend='chunked' only (FlexAttention's transposed "
                         "pass yields the log-sum-exp of the weights, not their max or power mean); pass "
                         "backend='chunked'")
    if backend == "chunked" and (not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
    sc = _scale(scale, D)
    with torch.no_grad():
        # on CUDA, half-precision inputs stay half precision for the kernel's tensor cores (the kernel
        # accumulates scores, the LSE subtraction and its log-sum-exp in float32); elsewhere float32
        dt = q.dtype if (q.is_cuda and backend == "flex" and q.dtype in (torch.bfloat16, torch.float16)) \
            else torch.float32
        qf = q.detach().to(dt).contiguous()
        kf_exp = _expand_kv(k.detach().to(dt), Hq).contiguous()
        lse_f = _mask_lse(_prep_lse(lse.detach()), query_mask).contiguous()
        if backend == "flex":
            log_sum = _flex_log_sum(qf, kf_exp, lse_f, window, sc, softcap=softcap)
        else:
            log_sum = _chunked_log_sum(qf, kf_exp, lse_f, window, sc, chunk, reduce, softcap=softcap)
        return _aggregate(log_sum, Hkv, window, eps, agg, power=power, query_mask=query_mask)
