"""The eviction settings of one evaluation run, parsed from ``key=value`` arguments and checked before any model
weights load (the lm-evaluation-harness ``kvpop`` model reads its ``model_args`` through here).

Arguments:

* ``policy``: any name of :data:`kvpop_hf.policies.POLICIES` (``dense``, ``streaming``, ``knorm``,
  ``snapkv``, ``kvpop``, ...).
* ``scorer``: a checkpoint folder (or Hub repo id) for the learned policies; for policies that bring their own
  weights (``kvpop_distill``, ``streaming_plus``, ``dms``, ...) it is the model folder and defaults to ``pretrained``.
* ``sinks``, ``window``: the sinks and protected window; default the checkpoint's, else 4 and 64 (kvpop-eval's).
* ``topk`` (long-range slots per layer and KV head, ``B = sinks + window + topk``) **or** ``compression`` (a
  ratio in (0, 1) of each request's context: ``B = round((1 - compression) * n)`` with ``n`` the number of real
  prompt tokens of the request, padding excluded; ``topk = max(0, B - sinks - window)``). Learned policies default
  to their checkpoint's ``topk``; every other compressing policy needs one of the two.

``B`` per request is :meth:`PolicyArgs.budget`; :meth:`PolicyArgs.make_cache` returns a fresh cache for it.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PolicyArgs", "parse_policy_args", "DEFAULT_SINKS", "DEFAULT_WINDOW"]

DEFAULT_SINKS = 4
DEFAULT_WINDOW = 64


@dataclass
class PolicyArgs:
    """A validated policy, its checkpoint prototype (loaded once, shared read-only) and its budget rule."""

    policy: str
    model_config: Any
    sinks: int | None = None
    window: int | None = None
    topk: int | None = None
    compression: float | None = None
    scorer_path: str | None = None
    prototype: Any = None
    short_requests: int = field(default=0, compare=False)  # requests whose B fell below sinks + window

    @property
    def dense(self) -> bool:
        from ..policies import POLICIES

        return POLICIES[self.policy].dense

    @property
    def chunk_exact(self) -> bool:
        """True when feeding tokens in one chunk gives the same logits as decoding them one by one (static
        priorities under the ``kvpop`` attention, the eviction contract); False for attention-scored policies (TOVA,
        H2O, SnapKV compress a prompt chunk at its end) and for caches other than KVpopCache (DMS)."""
        from ..cache import KVpopCache

        if self.dense:
            return True
        cache = self.make_cache(1 << 20)
        return isinstance(cache, KVpopCache) and cache.prefill_chunks_exact

    def budget(self, n_ctx: int) -> tuple[int, int, int] | None:
        """``(sinks, window, topk)`` for a request with ``n_ctx`` real context tokens; None for dense and DMS."""
        from ..policies import POLICIES

        if self.dense or self.policy == "dms":
            return None
        s, w = self.sinks, self.window
        if self.compression is not None:
            B = int(round((1.0 - self.compression) * n_ctx))
            if POLICIES[self.policy].window_only:
                return s, max(1, B - s), 0
            k = B - s - w
            if k < 0:
                self.short_requests += 1
            return s, w, max(0, k)
        if POLICIES[self.policy].window_only:  # sinks + window only: the whole budget is window
            return s, w + self.topk, 0
        return s, w, self.topk

    def make_cache(self, n_ctx: int):
        """A fresh ``past_key_values`` for one request or batch (None = transformers' dense cache)."""
        from ..policies import POLICIES

        if self.dense:
            return None
        pol = POLICIES[self.policy]
        if self.policy == "dms":
            return pol.factory(self.model_config, 0, 1, 0, checkpoint=self.prototype)
        s, w, k = self.budget(n_ctx)
        return pol.factory(self.model_config, s, w, k, checkpoint=self.prototype)

    def describe(self) -> dict:
        """What to record beside the results."""
        return {"policy": self.policy, "scorer": self.scorer_path, "sinks": self.sinks, "window": self.window,
                "topk": self.topk, "compression": self.compression}


def _fail(msg: str):
    raise ValueError(f"kvpop model_args: {msg}")


def _as_int(name: str, value: Any, minimum: int) -> int | None:
    """``value`` as an int ``>= minimum`` (0 or 1); lm-eval's command line reads ``-3`` as the float ``-3.0``,
    so a float with an integral value counts as that integer."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            _fail(f"{name}={value!r} is not an integer; give e.g. {name}=64.")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None or number < minimum:
        kind = "a non-negative integer" if minimum == 0 else f"an integer >= {minimum}"
        _fail(f"{name} must be {kind}, got {value!r}; give e.g. {name}=64.")
    return int(number)


def _as_ratio(value: Any) -> float | None:
    if value is None or value == "":
        return None
    try:
        cr = float(value)
    except (TypeError, ValueError):
        _fail(f"compression={value!r} is not a number; give a ratio in (0, 1), e.g. compression=0.88.")
    if math.isnan(cr) or not 0.0 < cr < 1.0:
        _fail(f"compression={value!r} must be a ratio in (0, 1) (B = round((1 - compression) * context tokens)); "
              "for a token budget give topk= instead.")
    return cr


def parse_policy_args(model_config, pretrained: str | None = None, policy: str = "kvpop", scorer: str | None = None,
                      sinks=None, window=None, topk=None, compression=None) -> PolicyArgs:
    """Check the arguments against the policy registry and the model shape; load the checkpoint once.

    ``model_config``: the evaluated model's ``PretrainedConfig`` (read before its weights load).
    Every error is a ValueError naming the argument and the fix.
    """
    from ..cache import _check_model_shape
    from ..config import model_config_of
    from ..policies import POLICIES, load_prototype

    policy = str(policy).strip()
    if policy not in POLICIES:
        _fail(f"unknown policy={policy!r}; use one of {', '.join(sorted(POLICIES))}.")
    pol = POLICIES[policy]
    sinks, window, topk = _as_int("sinks", sinks, 0), _as_int("window", window, 1), _as_int("topk", topk, 0)
    cr = _as_ratio(compression)
    if topk is not None and cr is not None:
        _fail(f"give topk= (long-range slots) or compression= (ratio of each context), not both "
              f"(got topk={topk}, compression={compression}).")
    if pol.dense:
        given = [n for n, v in (("scorer", scorer), ("sinks", sinks), ("window", window), ("topk", topk),
                                ("compression", cr)) if v is not None]
        if given:
            _fail(f"policy=dense keeps every token; drop {', '.join(given)} (or pick a compressing policy).")
        return PolicyArgs(policy, model_config)
    scorer = None if scorer in (None, "") else str(scorer)
    if pol.own_model:
        if scorer is not None and pretrained is not None and scorer != str(pretrained):
            _fail(f"policy={policy} brings its own weights: pretrained= is its model folder and holds the "
                  f"checkpoint, so leave scorer= out (got pretrained={pretrained}, scorer={scorer}).")
        scorer = scorer or (str(pretrained) if isinstance(pretrained, str) else None)
    if pol.needs_checkpoint and scorer is None:
        _fail(f"policy={policy} is learned and needs scorer=DIR (a folder written by KVpopCache.save_pretrained or "
              "training/retrofit.py).")
    if not pol.needs_checkpoint and scorer is not None:
        _fail(f"policy={policy} takes no scorer checkpoint; drop scorer={scorer} or use a learned policy "
              "(kvpop, kvpop_mlp, ...).")
    proto = None
    if scorer is not None:
        proto = load_prototype(policy, scorer)  # ValueError naming the checkpoint and the expected scorer
        cfg = getattr(proto, "kvpop_config", None) or getattr(proto, "dms_config", None)
        try:
            _check_model_shape(cfg, model_config_of(model_config), f"kvpop model_args: the scorer={scorer}")
        except ValueError as err:
            raise ValueError(f"{err} (pretrained={pretrained})") from None
    if policy == "dms":
        given = [n for n, v in (("sinks", sinks), ("window", window), ("topk", topk), ("compression", cr))
                 if v is not None]
        if given:
            _fail(f"policy=dms takes its sinks, window and eviction rate from its checkpoint; drop "
                  f"{', '.join(given)}.")
        return PolicyArgs(policy, model_config, scorer_path=scorer, prototype=proto)
    ckpt = getattr(proto, "kvpop_config", None)
    sinks = sinks if sinks is not None else (ckpt.sinks if ckpt is not None else DEFAULT_SINKS)
    window = window if window is not None else (ckpt.window if ckpt is not None else DEFAULT_WINDOW)
    if topk is None and cr is None:
        if ckpt is None:
            _fail(f"policy={policy} needs a budget: topk=K (B = sinks + window + K per layer and KV head) or "
                  "compression=R (a ratio of each request's context, e.g. 0.88).")
        topk = ckpt.topk
    return PolicyArgs(policy, model_config, sinks=sinks, window=window, topk=topk, compression=cr,
                      scorer_path=scorer, prototype=proto)
