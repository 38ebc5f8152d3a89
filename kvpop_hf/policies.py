"""Eviction policies by name, budgets and scorer checkpoints for the evaluation CLI.

A *policy factory* has the signature ``factory(model_config, sinks, window, topk, checkpoint=None)``
and returns a fresh ``past_key_values`` object (or ``None`` = transformers' default dense cache).
:data:`POLICIES` maps names to :class:`Policy` records; new baselines (TOVA, H2O, SnapKV, DMS, KVP,
...) plug in with :func:`register_policy` and then work in ``kvpop-eval --policies``.

Budgets (KVpop arXiv:2607.05061, Eq. 1: ``B = s + w + k`` per layer and KV head) are given as compression
ratios relative to the evaluation length (``--compression 0.75`` -> ``B = round(0.25 * length)``), as token
counts (``--budgets 256``), or both; ``sinks`` and ``window`` are fixed and ``topk = B - sinks - window``.

Learned policies read a checkpoint directory (or Hub repo id) written by
``KVpopCache.save_pretrained``. Checkpoints are found per (policy, budget tag) where the tag is
``cr<NN>`` (``NN = round(100 * cr)``) or ``b<B>``; an untagged checkpoint serves every budget (its
``sinks/window/topk`` are overridden by the requested budget).

Policies with ``own_model=True`` (``streaming_plus``) bring their own weights: their checkpoint is a whole
model directory (``config.json`` + ``model.safetensors`` + ``kvpop_config.json``, as written by
``training/retrofit.py --merge_lora True``), and ``kvpop-eval`` runs them with that model instead of
``--model``. ``window_only=True`` spends the budget on sinks and window alone: ``w = B - s``, ``k = 0``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["Policy", "POLICIES", "register_policy", "Budget", "parse_budgets", "parse_token_counts", "budget_tags",
           "parse_checkpoint_specs", "scan_checkpoints_dir", "resolve_checkpoint", "load_prototype",
           "bind_factory", "policy_budget"]

PolicyFactory = Callable[..., Any]


@dataclass(frozen=True)
class Policy:
    """A named eviction policy.

    factory: ``(model_config, sinks, window, topk, checkpoint=None) -> cache | None``.
    needs_checkpoint: the factory requires a checkpoint (learned scorers).
    expect: for learned policies, fields the checkpoint's ``KVpopConfig`` must match, e.g.
        ``{"scorer": "mlstm", "delayed": True}`` (``delayed`` is read from ``scorer_kwargs``).
    dense: the policy keeps every token (run once, not per budget).
    own_model: the checkpoint is a model directory whose weights replace ``--model`` for this policy.
    window_only: the budget is ``s + (B - s) + 0`` (sinks and window only) whatever ``--window`` says.
    loader: ``path -> prototype`` for checkpoints that are not KVpopCache checkpoints (default
        ``KVpopCache.from_pretrained``).
    """

    name: str
    factory: PolicyFactory
    needs_checkpoint: bool = False
    expect: dict = field(default_factory=dict)
    dense: bool = False
    description: str = ""
    own_model: bool = False
    window_only: bool = False
    loader: Callable[[str], Any] | None = None


POLICIES: dict[str, Policy] = {}


def register_policy(name: str, factory: PolicyFactory, *, needs_checkpoint: bool = False,
                    expect: dict | None = None, dense: bool = False, description: str = "",
                    own_model: bool = False, window_only: bool = False,
                    loader: Callable[[str], Any] | None = None) -> Policy:
    """Register (or replace) a policy; returns its record."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_\-]*", name):
        raise ValueError(f"Bad policy name {name!r}: use letters, digits, '_' and '-'.")
    if own_model and not needs_checkpoint:
        raise ValueError(f"Policy {name!r}: own_model=True needs needs_checkpoint=True (the model directory).")
    pol = Policy(name, factory, needs_checkpoint, dict(expect or {}), dense, description, own_model, window_only,
                 loader)
    POLICIES[name] = pol
    return pol


# -- built-in policies -------------------------------------------------------------------------------
def _dense(model_config, sinks, window, topk, checkpoint=None):
    return None  # exact_match / model(...) then use the default DynamicCache


def _heuristic(scorer: str, **scorer_kwargs) -> PolicyFactory:
    def factory(model_config, sinks, window, topk, checkpoint=None):
        from .cache import KVpopCache

        return KVpopCache(model_config, sinks=sinks, window=window, topk=topk, scorer=scorer,
                          scorer_kwargs=dict(scorer_kwargs) or None)

    factory.__name__ = f"{scorer}_factory"
    return factory


def _lagkv(model_config, sinks, window, topk, checkpoint=None):
    """LagKV with the lag equal to the window: each token is measured against the tokens that follow it."""
    return _heuristic("lagkv", lag=window)(model_config, sinks, window, topk, checkpoint)


def _snapkv(model_config, sinks, window, topk, checkpoint=None):
    """SnapKV with the observation window equal to the protected window (the observing queries stay cached)."""
    return _heuristic("snapkv", obs_window=window)(model_config, sinks, window, topk, checkpoint)


def _learned(model_config, sinks, window, topk, checkpoint=None):
    """Fresh cache from a checkpoint (a path / repo id, or a prototype KVpopCache from
    :func:`load_prototype`, whose scorer weights are shared, read-only, by all caches)."""
    from .cache import KVpopCache
    from .tensor_parallel import slice_heads

    if checkpoint is None:
        raise ValueError("This policy needs a scorer checkpoint.")
    if not isinstance(checkpoint, KVpopCache):  # a path: loaded as a prototype (from_pretrained refuses other
        checkpoint = KVpopCache.from_pretrained(checkpoint)  # sinks/window; the evaluation's budget applies below)
    cfg = _config_copy(checkpoint.kvpop_config, sinks=sinks, window=window, topk=topk)
    cache = KVpopCache(model_config, scorer=checkpoint.scorer, kvpop_config=cfg)
    if checkpoint.log_gamma is not None:  # a full prototype's per-head decay cut to this rank's heads, as its scorer
        heads = cache.tp_kv_heads if checkpoint.tp_kv_heads is None else None
        cache.log_gamma = slice_heads(checkpoint.log_gamma.clone(), heads)
    return cache


def _dms(model_config, sinks, window, topk, checkpoint=None):
    """A fresh DMSCache from a DMS checkpoint (its gate, sinks and window; ``topk`` does not apply)."""
    from .baselines.dms import DMSCache, DMSPrototype

    if checkpoint is None:
        raise ValueError("The DMS policy needs a checkpoint written by training/train_dms.py.")
    proto = checkpoint if isinstance(checkpoint, DMSPrototype) else DMSCache.from_pretrained(checkpoint)
    return proto.make(model_config)


def _load_dms(path):
    from .baselines.dms import DMSCache

    return DMSCache.from_pretrained(path)


def _config_copy(cfg, **changes):
    """A validated copy of a KVpopConfig with some fields changed."""
    import dataclasses

    out = dataclasses.replace(cfg, scorer_kwargs=dict(cfg.scorer_kwargs), **changes)
    out.validate()
    return out


register_policy("dense", _dense, dense=True, description="full KV cache (DynamicCache)")
register_policy("streaming", _heuristic("streaming"), description="StreamingLLM: sinks + window of w + k")
register_policy("knorm", _heuristic("knorm"), description="K-Norm: keep low-norm keys")
register_policy("random", _heuristic("random", seed=0), description="seeded random priorities")
register_policy("lagkv", _lagkv,
                description="LagKV: keys/values that stand out against the window that follows them (lag = w)")
register_policy("keydiff", _heuristic("keydiff"),
                description="KeyDiff: keep keys far from the mean key (cosine), read when they leave the window")
# attention-based, scores change every step (docs/design.md §7); a prompt chunk attends densely and is
# compressed at its end, so teacher-forced token accuracy feeds them the target token by token
register_policy("tova", _heuristic("tova"),
                description="TOVA: evict the entry the latest query attends to least (needs the kvpop attention)")
register_policy("h2o", _heuristic("h2o"),
                description="H2O: keep heavy hitters by accumulated attention + the recent window (kvpop attention)")
register_policy("snapkv", _snapkv,
                description="SnapKV: prompt entries voted by the last w queries, pooled (kernel 5, avg); fixed while "
                            "decoding, new tokens only take free slots (kvpop attention)")
# StreamingLLM+ (KVpop arXiv:2607.05061, trained-window baseline): sinks + window only, with the model distilled
# at that budget (training/retrofit.py --scorer streaming --topk 0 --lora_rank R --merge_lora True)
register_policy("streaming_plus", _learned, needs_checkpoint=True, expect={"scorer": "streaming"}, own_model=True,
                window_only=True,
                description="StreamingLLM+: sinks + window (k = 0) with the model LoRA-distilled at that budget")
# DMS (learned gates, ragged memory per head; kvpop_hf/baselines/dms): the checkpoint is the distilled model with its gate
# (training/train_dms.py); the budget is met on average over heads, as trained, not per head
register_policy("dms", _dms, needs_checkpoint=True, own_model=True, loader=_load_dms,
                description="DMS: learned per-head eviction gates with delayed eviction (window w), model distilled; "
                            "memory per head is ragged (kvpop attention)")
register_policy("kvpop_mlp", _learned, needs_checkpoint=True, expect={"scorer": "mlp"},
                description="learned stateless MLP scorer (KVpop_mlp)")
register_policy("kvpop", _learned, needs_checkpoint=True, expect={"scorer": "mlstm", "delayed": True},
                description="learned mLSTM scorer, delayed scoring (KVpop)")
# the same scorers trained otherwise (training/retrofit.py): with the model LoRA-distilled at the budget
# (--lora_rank R --merge_lora True; the checkpoint is a whole model directory) or on the mean future-attention
# target (--target_reduce mean, the paper's) instead of the max one
register_policy("kvpop_mlp_distill", _learned, needs_checkpoint=True, expect={"scorer": "mlp"}, own_model=True,
                description="KVpop_mlp with the model LoRA-distilled at the budget (distillation + boundary loss)")
register_policy("kvpop_distill", _learned, needs_checkpoint=True, expect={"scorer": "mlstm", "delayed": True},
                own_model=True,
                description="KVpop with the model LoRA-distilled at the budget (distillation + boundary loss)")
register_policy("kvpop_mlp_mean", _learned, needs_checkpoint=True, expect={"scorer": "mlp"},
                description="KVpop_mlp trained on the mean (paper's) future-attention target")
register_policy("kvpop_mean", _learned, needs_checkpoint=True, expect={"scorer": "mlstm", "delayed": True},
                description="KVpop trained on the mean (paper's) future-attention target")
register_policy("kvpop_mlp_mean_distill", _learned, needs_checkpoint=True, expect={"scorer": "mlp"}, own_model=True,
                description="KVpop_mlp on the mean future-attention target, model LoRA-distilled at the budget")
register_policy("kvpop_mean_distill", _learned, needs_checkpoint=True, expect={"scorer": "mlstm", "delayed": True},
                own_model=True,
                description="KVpop on the mean future-attention target, model LoRA-distilled at the budget")
register_policy("kvp", _learned, needs_checkpoint=True, expect={"scorer": "kvp", "trained_with": "rl"},
                description="KVP: per-head MLP agent on key/value/position trained offline by RL (training/train_kvp.py)")
register_policy("kvp_supervised", _learned, needs_checkpoint=True,
                expect={"scorer": "kvp", "trained_with": "supervised"},
                description="KVP agent trained with a supervised ranking loss (ablation)")
register_policy("kvpop_immediate", _learned, needs_checkpoint=True, expect={"scorer": "mlstm", "delayed": False},
                description="mLSTM scorer read immediately (ablation, paper Fig. 5)")


# -- budgets -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Budget:
    """One budget: ``B = sinks + window + topk`` tokens per layer and KV head; ``cr = max(0, 1 - B / length)``."""

    B: int
    cr: float
    sinks: int
    window: int
    spec: str  # as given: a --compression ratio (with a '.' or an exponent) or a --budgets token count

    @property
    def topk(self) -> int:
        return self.B - self.sinks - self.window

    @property
    def tag(self) -> str:
        """``cr75`` when given as a ratio, else ``b<B>``."""
        return budget_tags(self)[0]


def budget_tags(b: Budget) -> list[str]:
    """Checkpoint tags that match this budget, most specific first."""
    crtag, btag = f"cr{round(100 * b.cr)}", f"b{b.B}"
    return [crtag, btag] if _is_ratio(b.spec) else [btag, crtag]


def _is_ratio(spec: str) -> bool:
    return "." in spec or "e" in spec.lower()


def _items(values: str | Sequence | None) -> list[str]:
    """``"0.75,0.88"`` or ``[0.75, "0.88"]`` -> ``["0.75", "0.88"]``; ``None`` -> ``[]``."""
    if values is None:
        return []
    if isinstance(values, str):
        return [t for t in values.replace(" ", "").split(",") if t]
    return [str(v).strip() for v in values]


def _ratio_tokens(spec: str, length: int) -> int:
    """``B = round((1 - cr) * length)`` of one ``--compression`` value."""
    if re.fullmatch(r"\+?\d+", spec) and int(spec) >= 1:
        raise ValueError(f"--compression {spec}: {spec} is a token count, not a compression ratio: give it as "
                         f"--budgets {int(spec)} (B = sinks + window + topk entries per layer and KV head).")
    try:
        cr = float(spec)
    except ValueError:
        raise ValueError(f"Bad --compression value {spec!r}: expected a ratio in (0, 1) like 0.88.") from None
    if math.isnan(cr) or not 0.0 < cr < 1.0:
        raise ValueError(f"Compression ratio {spec} must be in (0, 1) (B = round((1 - cr) * length)); "
                         "give token counts to --budgets.")
    return int(round((1.0 - cr) * length))


def parse_token_counts(values: str | Sequence | None, flag: str = "--budgets") -> list[int]:
    """``"256,512"`` -> ``[256, 512]``: whole token counts only; a compression ratio (``0.88``) is a ValueError
    naming ``--compression``, any other non-integer one naming the expected form. ``flag`` names the option."""
    out = []
    for spec in _items(values):
        try:
            out.append(int(spec))
            continue
        except ValueError:
            pass
        try:
            x = float(spec)
        except ValueError:
            x = math.nan
        if 0.0 < x < 1.0:
            raise ValueError(f"{flag} {spec}: {spec} is a compression ratio: give it as --compression {spec} "
                             f"({flag} takes token counts B = sinks + window + topk, e.g. 256).")
        raise ValueError(f"Bad {flag} value {spec!r}: expected a whole token count like 256 (B = sinks + window + "
                         "topk entries per layer and KV head); compression ratios go to --compression.")
    return out


def parse_budgets(*, compression: str | Sequence | None = None, budgets: str | Sequence | None = None,
                  length: int, sinks: int, window: int) -> list[Budget]:
    """Budgets from ``compression`` ratios in (0, 1) (``"0.75,0.88"``: ``B = round((1 - cr) * length)``) and from
    ``budgets`` token counts (``"256,512"``: ``B`` itself), the ratios first, each list in its order.

    Raises ValueError when both are empty, for malformed values, a ratio among ``budgets`` or a whole number >= 1
    among ``compression`` (naming the other option), ratios outside (0, 1), duplicate ``B`` and budgets that leave
    no long-range slot (``B <= sinks + window``).
    """
    ratios, counts = _items(compression), _items(budgets)
    if not ratios and not counts:
        raise ValueError("No budget given: give compression ratios like --compression 0.75,0.88 and/or token counts "
                         "like --budgets 256,512.")
    tokens = parse_token_counts(counts)  # every value is checked before any budget is built
    given = [(spec, _ratio_tokens(spec, length)) for spec in ratios] + list(zip(counts, tokens))
    out: list[Budget] = []
    for spec, B in given:
        if B <= sinks + window:
            raise ValueError(
                f"Budget {spec} gives B={B} tokens, which is <= sinks + window = {sinks} + {window}: no long-range "
                "slots are left. Use a larger budget, a smaller --window or fewer --sinks.")
        if any(o.B == B for o in out):
            raise ValueError(f"Duplicate budget B={B} (from {spec!r}; {next(o.spec for o in out if o.B == B)!r} "
                             "gives the same).")
        out.append(Budget(B=B, cr=max(0.0, 1.0 - B / length), sinks=sinks, window=window, spec=spec))
    return out


# -- checkpoints -------------------------------------------------------------------------------------
_TAG_RE = re.compile(r"^(?P<name>.+?)(?:_(?P<tag>cr\d+|b\d+))?$")


def _norm_tag(tag: str) -> str:
    """'cr75' / 'b256' as is; '0.75' -> 'cr75'; '256' -> 'b256'."""
    tag = tag.strip().lower()
    if re.fullmatch(r"cr\d+|b\d+", tag):
        return tag
    try:
        if _is_ratio(tag):
            return f"cr{round(100 * float(tag))}"
        return f"b{int(tag)}"
    except ValueError:
        raise ValueError(f"Bad budget tag {tag!r}: use cr75, b256, 0.75 or 256.") from None


def parse_checkpoint_specs(specs: list[str]) -> dict[tuple[str, str | None], str]:
    """``["kvpop_mlp@cr75=dir", "kvpop=dir2", "kvpop=dir3@0.88"]`` ->
    ``{("kvpop_mlp", "cr75"): "dir", ("kvpop", None): "dir2", ("kvpop", "cr88"): "dir3"}``."""
    out: dict[tuple[str, str | None], str] = {}
    for spec in specs or []:
        if "=" not in spec:
            raise ValueError(f"--scorer-checkpoint expects POLICY[@BUDGET]=DIR, got {spec!r}.")
        key, path = spec.split("=", 1)
        name, _, tag = key.partition("@")
        m = re.fullmatch(r"(.+)@(cr\d+|b\d+|\d*\.\d+|\d+)", path)
        if not tag and m:  # also accept POLICY=DIR@TAG
            path, tag = m.group(1), m.group(2)
        name = name.strip()
        if name not in POLICIES:
            raise ValueError(f"--scorer-checkpoint: unknown policy {name!r}; known: {sorted(POLICIES)}.")
        if not POLICIES[name].needs_checkpoint:
            raise ValueError(f"--scorer-checkpoint: policy {name!r} takes no checkpoint.")
        out[(name, _norm_tag(tag) if tag else None)] = path
    return out


def scan_checkpoints_dir(root: str | Path) -> dict[tuple[str, str | None], str]:
    """Subdirectories ``<policy>[_cr<NN>|_b<B>]`` holding a ``kvpop_config.json``, for registered
    learned policies (e.g. ``kvpop_mlp_cr75``, ``kvpop_cr88``, ``kvpop_immediate``)."""
    from .hub import CONFIG_NAME

    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"--checkpoints-dir {root} is not a directory.")
    out: dict[tuple[str, str | None], str] = {}
    for sub in sorted(root.iterdir()):
        if not (sub / CONFIG_NAME).is_file():
            continue
        m = _TAG_RE.match(sub.name)
        name, tag = m.group("name"), m.group("tag")
        if tag is None and sub.name in POLICIES:
            name = sub.name
        if name in POLICIES and POLICIES[name].needs_checkpoint:
            out[(name, tag)] = str(sub)
    return out


def resolve_checkpoint(checkpoints: dict[tuple[str, str | None], str], policy: str, budget: Budget) -> str | None:
    """The checkpoint of ``policy`` for ``budget``: a tagged one first, then an untagged one."""
    for tag in budget_tags(budget) + [None]:
        if (policy, tag) in checkpoints:
            return checkpoints[(policy, tag)]
    return None


def load_prototype(policy: str, path: str):
    """Load a checkpoint once (no model shape yet) and check it is what ``policy`` expects."""
    from .cache import KVpopCache

    try:
        if POLICIES[policy].loader is not None:
            return POLICIES[policy].loader(path)
        proto = KVpopCache.from_pretrained(path)
    except (OSError, FileNotFoundError) as err:
        raise ValueError(f"Cannot load the {policy!r} checkpoint {path}: {err}") from err
    cfg = proto.kvpop_config
    for key, want in POLICIES[policy].expect.items():
        if key == "scorer":
            got = cfg.scorer
        else:
            got = cfg.scorer_kwargs.get(key, getattr(proto.scorer, key, None))
        if got != want:
            raise ValueError(f"Checkpoint {path} has {key}={got!r}, but policy {policy!r} expects {key}={want!r}.")
    return proto


def policy_budget(policy: str, budget: Budget) -> Budget:
    """The budget as ``policy`` spends it: unchanged, or sinks + window only (``k = 0``) for window-only policies."""
    import dataclasses

    return dataclasses.replace(budget, window=budget.B - budget.sinks) if POLICIES[policy].window_only else budget


def bind_factory(policy: str, checkpoint=None) -> Callable[[Any, int, int, int], Any]:
    """``(model_config, sinks, window, topk) -> cache`` with the checkpoint bound."""
    pol = POLICIES[policy]

    def factory(model_config, sinks, window, topk):
        return pol.factory(model_config, sinks, window, topk, checkpoint=checkpoint)

    return factory
