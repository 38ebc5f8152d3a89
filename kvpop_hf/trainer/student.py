"""The student forward used in training: attention implementation ``"kvpop_train"``.

In a forward run by :func:`student_forward` every layer (KVpop, arXiv:2607.05061 Sec. 3):

1. scores its detached keys/values with the scorer -> student priorities ``p^ [b, h, S]``;
2. runs the running top-k on ``p^`` -> per-query cutoff ranks -> exact fixed-budget sparse attention
   (FlexAttention), returning the output and each query's LSE;
3. computes the future-attention target with the transposed pass (LSE from the sparse forward,
   or from a dense pass with ``target_lse="dense"``), the target priorities and the target's
   running top-k -> boundary tokens and keep/drop labels;
4. records the boundary loss and the target top-k recall (:func:`target_topk_recall`).

The state of the call (scorer, settings, the record the layers fill) travels as the forward keyword
``kvpop_student``, which Qwen3/Llama-style models hand down to their attention function, so it belongs to
that call alone. A forward without it is plain causal attention, so the same model serves as the dense
teacher (e.g. a LoRA student with adapters disabled).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.profiler import record_function
from transformers import AttentionInterface, AttentionMaskInterface

from ..attention_variants import AttentionVariant, causal_visible, variant_attention
from ..backends import TRAINING_FIELDS, Backends
from ..ops.dense_attention import causal_attention
from ..ops.priority import decayed_priorities
from ..ops.running_topk import RunningTopK, running_topk
from .hidden_states import final_hidden_states
from .losses import balance_weights, boundary_loss, margin_weights
from ..ops.priorities import sequence_priorities
from .scorer_checkpoint import checkpointed_priorities
from ..ops.sparse_attention import apply_sinks, sparse_attention, sparse_attention_block_mask, sparse_attention_reference
from ..ops.targets import dense_causal_lse, future_attention_target

TRAIN_ATTN_NAME = "kvpop_train"
STUDENT_KWARG = "kvpop_student"  # forward keyword that carries a StudentCall


@dataclass
class StudentSettings:
    sinks: int
    window: int
    topk: int
    decay_step: int = 64
    boundary_temperature: float = 1.0
    omega: str = "none"  # none | margin | balance | margin+balance
    target_lse: str = "sparse"  # sparse (paper) | dense (exact)
    target_agg: str = "log_mean"
    target_reduce: str = "mean"  # mean (paper) | max | p<x> power mean (max and p<x>: chunked target pass only)
    target_queries: str = "all"  # all (paper) | labels: only queries whose next token is supervised count
    target_eps: float = 1e-6
    # the training implementations: a Backends or a dict of its fields (running_topk, train_attention,
    # target_pass; docs/backends.md), resolved for each device a forward meets (KVpopTrainer passes it resolved)
    backends: Backends | dict | None = None
    target_recall_queries: int = 8  # queries sampled per layer by target_topk_recall
    targets: bool = True  # False: no target pass / boundary loss (fixed scorer: only the backbone trains)

    def __post_init__(self):
        self.backends = Backends.coerce(self.backends)
        self.backends.check_target_reduce(self.target_reduce)


@dataclass
class StudentRecord:
    """Per-forward results, one entry per layer.

    ``decisions`` holds, per layer, what the layer computed without gradient (the student's running top-k,
    the teacher's boundary decisions and loss weights). Under gradient checkpointing a layer runs again in
    the backward pass; the second run reuses them instead of repeating the running top-k and the target pass
    (same inputs, same results), and repeats only what has a gradient: the scorer, the sparse attention and
    the boundary loss."""

    boundary: dict = field(default_factory=dict)
    target_recall: dict = field(default_factory=dict)
    keep_rate: dict = field(default_factory=dict)
    decisions: dict = field(default_factory=dict)


@dataclass
class LayerDecisions:
    """The gradient-free part of one layer's student pass (see :class:`StudentRecord`)."""

    student: RunningTopK  # rank / cutoff only (int32); the attention mask needs nothing else
    boundary: torch.Tensor | None = None  # [b, h, S] the target's boundary token per query, -1: none
    keep_new: torch.Tensor | None = None  # [b, h, S] bool
    omega: torch.Tensor | None = None  # [b, h, S] float32 loss weights or None
    block_mask: object | None = None  # the FlexAttention BlockMask of the student's sparse attention
    priorities: torch.Tensor | None = None  # [b, h, S] float32 student priorities (values)


class StudentCall:
    """What one student forward hands to the ``kvpop_train`` attention of every layer.

    Passed as the forward keyword ``kvpop_student``, so two forwards in two threads, a recomputation under
    gradient checkpointing (which replays the layer with the same keywords) and a forward after an exception
    each see their own state. A plain class, not a dataclass: wrappers that rebuild dataclass arguments
    (FSDP's mixed-precision cast of forward inputs) pass it on as is, so the layers fill this call's record.
    """

    __slots__ = ("scorer", "log_gamma", "settings", "record", "query_mask", "valid_queries", "layers", "_backends")

    def __init__(self, scorer, log_gamma, settings: StudentSettings, record: StudentRecord, query_mask=None,
                 valid_queries=None, layers=None):
        self.scorer, self.log_gamma, self.settings, self.record = scorer, log_gamma, settings, record
        self.query_mask, self.valid_queries = query_mask, valid_queries
        # model layer index -> scorer layer of the KVpop layers (None: every layer, scorer layer = model layer)
        self.layers = None if layers is None else {int(i): j for j, i in enumerate(layers)}
        self._backends = {}  # device -> the settings' backends resolved for it

    def backends(self, device: torch.device) -> Backends:
        """The training backends for tensors on ``device``: ``settings.backends`` resolved, once per call and
        device (a record that is resolved already reads no environment)."""
        if device not in self._backends:
            st = self.settings
            self._backends[device] = st.backends.resolve(device, TRAINING_FIELDS, st.target_reduce)
        return self._backends[device]

    def scorer_layer(self, layer_idx: int) -> int | None:
        """The scorer layer of decoder layer ``layer_idx``, None where the layer is not a KVpop layer."""
        return layer_idx if self.layers is None else self.layers.get(layer_idx)


def student_forward(model, scorer, settings: StudentSettings, log_gamma: torch.Tensor | None = None,
                    query_mask: torch.Tensor | None = None, valid_queries: torch.Tensor | None = None,
                    return_hidden: bool = False, layers=None, **inputs):
    """``model(**inputs)`` as the sparse student -> (model outputs, :class:`StudentRecord`).

    ``query_mask [B, S]`` (bool): the future queries the target counts (``targets.future_attention_target``);
    None: all of them. ``valid_queries [B, S]`` (bool): the real positions of a right-padded batch; padded queries
    get no boundary-loss term and no recall; None: all real. ``return_hidden=True``: no logits are computed
    (``outputs.logits`` is empty) and the final hidden states ``[B, S, H]`` come third, for
    :mod:`.chunked_distillation`. The model must run the ``"kvpop_train"`` attention
    (``model.set_attn_implementation("kvpop_train")``). ``layers``: the decoder layers that are KVpop layers
    (``KVpopConfig.layers``; scorer layer ``j`` serves ``layers[j]``), None: all of them; the other layers attend
    as the model does (sliding window, softcap, sinks)."""
    record = StudentRecord()
    call = StudentCall(scorer, log_gamma, settings, record, query_mask, valid_queries, layers)
    hidden = None
    if return_hidden:
        outputs, hidden = final_hidden_states(model, **inputs, **{STUDENT_KWARG: call})
    else:
        outputs = model(**inputs, **{STUDENT_KWARG: call})
    if not record.boundary:
        raise ValueError(f"No layer ran the student attention: call model.set_attn_implementation("
                         f"'{TRAIN_ATTN_NAME}') first (the model's forward must pass its keyword arguments on to "
                         "the attention function, as Qwen3/Llama-style transformers models do).")
    return (outputs, record, hidden) if return_hidden else (outputs, record)


def target_topk_recall(student, target, sinks: int, window: int, n_queries: int,
                        valid_queries: torch.Tensor | None = None) -> torch.Tensor:
    """Target top-k recall: mean over ``n_queries`` evenly spaced queries (from ``sinks + window`` on) of
    ``|kept_student(q) & kept_target(q)| / |kept_target(q)|``, with ``kept_x(q)`` the long-range tokens that
    the running top-k ``x`` (a :class:`~kvpop_hf.ops.running_topk.RunningTopK`) keeps at query ``q``.
    ``valid_queries [b, S]`` (bool, the real positions of a right-padded batch): each row's queries are spaced
    over its own real tokens, so a padded row gives the recall of the row alone.
    A cheap training signal on the batch; the evaluation metric is the testbed's oracle top-k recall."""
    if valid_queries is not None:
        rows = []
        for b, n in enumerate(valid_queries.sum(-1).tolist()):
            sub = [RunningTopK(rank=x.rank[b:b + 1, ..., :n], cutoff=x.cutoff[b:b + 1, ..., :n], boundary=None,
                               keep_new=None) for x in (student, target)]
            rows.append(target_topk_recall(*sub, sinks, window, n_queries))
        rows = torch.stack([r.to(student.rank.device) for r in rows])
        finite = rows[~rows.isnan()]
        return finite.mean() if finite.numel() else torch.tensor(float("nan"))
    S = student.rank.shape[-1]
    first = sinks + window  # first query with an eligible token
    if S <= first:
        return torch.tensor(float("nan"))
    q = torch.linspace(first, S - 1, n_queries, device=student.rank.device).round().long().unique()
    t = torch.arange(S, device=q.device)
    elig = (t[None, :] >= sinks) & (t[None, :] <= q[:, None] - window)  # [nq, S]

    def kept(res):
        return elig & (res.rank[..., None, :] <= res.cutoff[..., q][..., None])

    ks, kt = kept(student), kept(target)
    inter = (ks & kt).sum(-1).float()
    denom = kt.sum(-1).float().clamp_min(1)
    return (inter / denom).mean()


def kvpop_train_attention(module, query, key, value, attention_mask, scaling=None, dropout: float = 0.0, **kwargs):
    """query ``[b, Hq, S, d]``, key/value ``[b, Hkv, S, d]`` (whole sequences) -> (``[b, S, Hq, d]``, None)."""
    call = kwargs.get(STUDENT_KWARG)
    variant = AttentionVariant.of(kwargs, module)
    si = None if call is None else call.scorer_layer(module.layer_idx)
    if si is None:  # the dense teacher, or a layer that is not a KVpop layer: the model's own attention
        dropout = dropout if module.training else 0.0
        return model_attention(query, key, value, scaling, variant, kwargs.get("sliding_window"), dropout), None
    if kwargs.get("sliding_window") is not None:
        raise ValueError(f"Layer {module.layer_idx} is a sliding-window layer: KVpopTrainer retrofits KVpop on the "
                         "full-attention layers and keeps the sliding layers as the model runs them "
                         "(KVpopCache(..., sliding_layers='window')).")
    scorer, log_gamma, st, record = call.scorer, call.log_gamma, call.settings, call.record
    li = module.layer_idx  # records are kept per decoder layer
    lg = None if log_gamma is None else log_gamma[si]
    saved = record.decisions.get(li)  # set: this is the backward pass's recomputation of the layer
    backends = call.backends(query.device)
    with record_function("kvpop.scoring"):
        def score(k, v):
            return sequence_priorities(scorer, si, k, v, st.window, lg, st.decay_step)

        params = list(scorer.parameters()) + ([log_gamma] if log_gamma is not None else [])
        prio = checkpointed_priorities(score, key.detach(), value.detach(), params,
                                       known=None if saved is None else saved.priorities)
    if saved is None:
        with record_function("kvpop.running_topk"):
            ranked = running_topk(prio.detach(), st.sinks, st.window, st.topk, backend=backends.running_topk)
        student = RunningTopK(rank=ranked.rank.to(torch.int32), cutoff=ranked.cutoff.to(torch.int32),
                              boundary=None, keep_new=None)
    else:
        student = saved.student
    with record_function("kvpop.sparse_attention"):
        if backends.train_attention == "flex":
            block_mask = saved.block_mask if saved is not None else None
            if block_mask is None:
                block_mask = sparse_attention_block_mask(student, st.sinks, st.window, query.shape[1] // key.shape[1],
                                                         method=backends._train_block_mask)
            out, lse = sparse_attention(query, key, value, student, st.sinks, st.window, scaling, block_mask=block_mask,
                                        softcap=variant.softcap)
        else:
            block_mask = None
            out, lse = sparse_attention_reference(query, key, value, student, st.sinks, st.window, scaling,
                                                  softcap=variant.softcap)
        out, lse = apply_sinks(out, lse, variant.sinks)
    if not st.targets:
        record.boundary[li] = lse.new_zeros(())
        record.decisions.setdefault(li, LayerDecisions(student, block_mask=block_mask, priorities=prio.detach()))
        return out.transpose(1, 2).contiguous(), None
    S = prio.shape[-1]
    t_new = (torch.arange(S, device=prio.device) - st.window).view(1, 1, S).expand_as(prio)
    if saved is not None:
        with record_function("kvpop.boundary_loss"):
            record.boundary[li] = boundary_loss(prio, t_new, saved.boundary.long(), saved.keep_new,
                                                temperature=st.boundary_temperature, omega=saved.omega,
                                                valid=saved.boundary >= 0)
        return out.transpose(1, 2).contiguous(), None
    with torch.no_grad(), record_function("kvpop.target_pass"):
        q_d, k_d = query.detach(), key.detach()
        lse_used = lse.detach() if st.target_lse == "sparse" else dense_causal_lse(
            q_d, k_d, scaling, softcap=variant.softcap, sinks=variant.sinks)
        qmask = None if call.query_mask is None else call.query_mask.to(q_d.device)
        r_tgt = future_attention_target(q_d, k_d, lse_used, st.window, eps=st.target_eps, agg=st.target_agg,
                                        scale=scaling, backend=backends.target_pass, reduce=st.target_reduce,
                                        query_mask=qmask,
                                        softcap=variant.softcap)
        S = r_tgt.shape[-1]
        p_tgt = r_tgt if lg is None else decayed_priorities(r_tgt, torch.arange(S, device=r_tgt.device),
                                                            lg.detach(), st.decay_step)
        with record_function("kvpop.running_topk"):
            target = running_topk(p_tgt, st.sinks, st.window, st.topk, backend=backends.running_topk)
        omega = None
        valid = target.boundary >= 0
        if call.valid_queries is not None:  # padded queries of a right-padded batch: no decision, no loss
            valid = valid & call.valid_queries.to(valid.device)[:, None, :]
        if "margin" in st.omega:
            omega = margin_weights(p_tgt, t_new, target.boundary, valid=valid)
        if "balance" in st.omega:
            bal = balance_weights(target.keep_new, valid)
            omega = bal if omega is None else omega * bal
        record.target_recall[li] = target_topk_recall(student, target, st.sinks, st.window,
                                                        st.target_recall_queries, call.valid_queries)
        record.keep_rate[li] = target.keep_new[valid].float().mean() if valid.any() else torch.tensor(float("nan"))
        record.decisions[li] = LayerDecisions(student, target.boundary.masked_fill(~valid, -1).to(torch.int32),
                                              target.keep_new, omega,
                                              block_mask, prio.detach())
    with record_function("kvpop.boundary_loss"):
        record.boundary[li] = boundary_loss(prio, t_new, target.boundary, target.keep_new,
                                            temperature=st.boundary_temperature, omega=omega, valid=valid)
    return out.transpose(1, 2).contiguous(), None


def model_attention(query, key, value, scaling, variant: AttentionVariant, sliding_window: int | None,
                    dropout: float = 0.0):
    """Causal attention over a whole unpadded sequence as the model computes it: its sliding window, softcap and
    sinks. query ``[b, Hq, S, d]``, key/value ``[b, Hkv, S, d]`` -> ``[b, S, Hq, d]``. A plain full-attention layer
    takes SDPA's causal kernel, anything else the torch reference (:mod:`kvpop_hf.attention_variants`)."""
    if variant.plain and sliding_window is None:
        return causal_attention(query, key, value, None, scaling, dropout)
    mask = causal_visible(query.shape[2], key.shape[2], sliding_window, query.device)
    if variant.plain:
        return causal_attention(query, key, value, mask, scaling, dropout)
    return variant_attention(query, key, value, mask, scaling, variant, dropout)


def _train_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                attention_mask=None, **kwargs):
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("KVpop training needs unpadded sequences (the sparse mask is defined on real token "
                         "positions): batch sequences of equal length or use a batch size of 1.")
    return None


def register() -> None:
    AttentionInterface.register(TRAIN_ATTN_NAME, kvpop_train_attention)
    AttentionMaskInterface.register(TRAIN_ATTN_NAME, _train_mask)


register()
