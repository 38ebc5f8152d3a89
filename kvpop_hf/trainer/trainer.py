"""KVpopTrainer: retrofit a causal LM with KVpop scorers at a fixed budget (KVpop, arXiv:2607.05061).

Loss per batch: ``distill_weight * KL(teacher || student) + boundary_weight * mean_layers L_bnd``
where the student runs the exact fixed-budget sparse attention (``"kvpop_train"``) and the
teacher is the frozen dense model: a separate copy, or the same weights with LoRA adapters
disabled when the student is a PEFT model. Scorer inputs are detached from the backbone.

A fixed (parameter-free) scorer such as ``"streaming"`` with ``train_backbone=True`` distils the backbone
alone at that budget (StreamingLLM+ with ``topk=0``: the trained-window baseline of the paper); the
boundary-loss target pass is then skipped, since no scorer parameter would use it.

A run that trains the backbone saves, in every checkpoint directory, the model (``config.json`` +
``model.safetensors``, or the LoRA adapter) *and* the scorer (``kvpop_config.json`` +
``kvpop_scorer.safetensors``), so ``AutoModelForCausalLM.from_pretrained(d)`` and
``KVpopCache.from_pretrained(d)`` load from it. A scorer-only run (``train_backbone=False``) leaves the
backbone as it was loaded, so its directories hold the scorer and the tokenizer only (and, in checkpoint-N
folders, the optimizer and trainer state that resuming needs):
the model is the base model (``kvpop_config.json``'s ``base_model``), and resuming reads the scorer alone.
Every directory also holds ``custom_generate/generate.py``, transformers' generate hook
(:mod:`kvpop_hf.hub_generate`): ``generate`` with this checkpoint's cache on the device's fastest path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import TrainingArguments

from .. import hub
from ..backends import TRAINING_FIELDS, Backends
from ..config import KVpopConfig, model_shape
from ..hub_generate import write_hook
from ..layer_types import config_layer_fields, layer_plan
from ..scorers import build_scorer
from .chunked_distillation import chunked_lm_loss
from .distillation import DistillationTrainer, StudentPass
from .hidden_states import head_weights, lm_head_of, unwrap_model
from .student import TRAIN_ATTN_NAME, StudentSettings, student_forward
from ..ops.targets import reduce_power
from .teacher_distillation import final_logit_softcap, supervised_positions

SCORER_ATTR = "kvpop_scorer"
LEARNED_SCORERS = ("mlp", "mlstm")
FIXED_SCORERS = ("streaming", "knorm", "random")  # static, parameter-free: the backbone is what trains
LOG_GAMMA_ATTR = "kvpop_log_gamma"


@dataclass
class KVpopTrainingArguments(TrainingArguments):
    """`TrainingArguments` plus the KVpop budget, scorer and loss settings."""

    sinks: int = field(default=4, metadata={"help": "s: first tokens always kept."})
    window: int = field(default=256, metadata={"help": "w: protected recent window."})
    topk: int = field(default=1788, metadata={"help": "k: long-range slots per KV head."})
    scorer: str = field(default="mlstm", metadata={
        "help": "mlp | mlstm (learned scorers) | streaming | knorm | random (fixed; backbone distillation only)."})
    scorer_kwargs: str = field(default="{}", metadata={
        "help": "JSON dict of scorer options, e.g. '{\"state_dim\": 32}'; the mlstm scorer's paper readout alone "
                "(without the read token's own term) is '{\"token_readout\": false}'."})
    log_gamma: float | None = field(default=None, metadata={"help": "Initial log decay per head (<0); None: no decay."})
    learn_decay: bool = field(default=False, metadata={"help": "Learn the per-head decay gamma_h."})
    decay_step: int = field(default=64, metadata={"help": "n: decay block size."})
    boundary_temperature: float = field(default=1.0, metadata={
        "help": "Temperature of the boundary loss: softplus(-y (p_new - p_bnd) / boundary_temperature)."})
    omega: str = field(default="none", metadata={"help": "Boundary loss weights: none | margin | balance | margin+balance."})
    boundary_weight: float = field(default=1.0)
    distill_weight: float = field(default=1.0)
    distill_temperature: float = field(default=1.0)
    target_lse: str = field(default="sparse", metadata={"help": "sparse (paper's approximation) | dense (exact)."})
    target_agg: str = field(default="log_mean", metadata={"help": "log_mean | mean_log (over query heads)."})
    target_reduce: str = field(default="mean", metadata={
        "help": "mean (paper: mean future attention) | max (largest future attention weight) | p<x>, e.g. p4 (power "
                "mean of order x > 1 of the future attention weights, between the two); max and p<x> run the "
                "chunked target pass."})
    target_queries: str = field(default="all", metadata={
        "help": "all (paper: every later query counts in the target) | labels (only the queries whose next token "
                "has a label, i.e. those that produce the supervised answer; needs labels)."})
    scorer_learning_rate: float | None = field(default=None, metadata={"help": "Scorer LR (default: learning_rate)."})
    train_backbone: bool = field(default=True, metadata={"help": "False: train the scorer only (no teacher needed)."})
    backends: dict | str | None = field(default=None, metadata={
        "help": "The training implementations, fields of kvpop_hf.Backends (docs/backends.md) as a JSON object, e.g. "
                "'{\"running_topk\": \"triton\"}' (in Python also a Backends or a dict); a field not given: its "
                "KVPOP_<FIELD> environment variable, else auto. Resolved once, for args.device, by KVpopTrainer."})

    def __post_init__(self):
        if self.gradient_checkpointing:
            kwargs = self.gradient_checkpointing_kwargs or {}
            kwargs = dict(json.loads(kwargs) if isinstance(kwargs, str) else kwargs)
            if kwargs.get("use_reentrant", False):
                raise ValueError("KVpopTrainer needs non-reentrant gradient checkpointing: the boundary loss is "
                                 "formed inside the checkpointed layers, and a reentrant checkpoint runs them "
                                 "without gradient, so the scorer would get none. Drop use_reentrant=True from "
                                 "gradient_checkpointing_kwargs.")
            kwargs["use_reentrant"] = False  # transformers releases differ in their default
            self.gradient_checkpointing_kwargs = kwargs
        super().__post_init__()
        self.remove_unused_columns = False
        if self.ddp_find_unused_parameters is None:
            # the scorer's gradient flows through the boundary loss, not through the logits, so DDP's
            # unused-parameter search (which walks back from the outputs) would mark it ready twice
            self.ddp_find_unused_parameters = False
        KVpopConfig(sinks=self.sinks, window=self.window, topk=self.topk, scorer=self.scorer,
                    log_gamma=self.log_gamma, decay_step=self.decay_step)  # validates
        if self.scorer not in LEARNED_SCORERS + FIXED_SCORERS:
            raise ValueError(f"KVpopTrainer trains a learned scorer ({' | '.join(LEARNED_SCORERS)}) or distils the "
                             f"backbone under a fixed one ({' | '.join(FIXED_SCORERS)}); got {self.scorer!r}.")
        if self.scorer in FIXED_SCORERS and not (self.train_backbone and self.distill_weight > 0):
            raise ValueError(f"The {self.scorer!r} scorer has no parameters: train the backbone "
                             "(train_backbone=True, distill_weight > 0), e.g. a LoRA student (--lora_rank).")
        if self.scorer in LEARNED_SCORERS and self.topk == 0:
            raise ValueError("topk=0 leaves a learned scorer nothing to choose: use scorer='streaming' for a "
                             "sinks + window budget (StreamingLLM+).")
        if self.omega not in ("none", "margin", "balance", "margin+balance"):
            raise ValueError(f"omega must be none | margin | balance | margin+balance, got {self.omega!r}.")
        if self.target_lse not in ("sparse", "dense"):
            raise ValueError(f"target_lse must be 'sparse' or 'dense', got {self.target_lse!r}.")
        try:
            reduce_power(self.target_reduce)
        except ValueError as err:
            raise ValueError(f"target_reduce: {err}.") from None
        if self.target_queries not in ("all", "labels"):
            raise ValueError(f"target_queries must be 'all' or 'labels', got {self.target_queries!r}.")
        self.backends = _backends_given(self.backends, self.target_reduce)
        if self.learn_decay and self.log_gamma is None:
            raise ValueError("learn_decay=True needs an initial log_gamma (< 0).")
        try:
            kwargs = json.loads(self.scorer_kwargs) if isinstance(self.scorer_kwargs, str) else dict(self.scorer_kwargs)
        except json.JSONDecodeError as err:
            raise ValueError(f"scorer_kwargs must be a JSON object: {err}") from err
        self.scorer_kwargs = json.dumps(kwargs)

    def training_backends(self) -> Backends:
        """The training fields of ``backends`` resolved for ``self.device`` (docs/backends.md)."""
        return Backends.coerce(self.backends).resolve(self.device, TRAINING_FIELDS, self.target_reduce)

    def kvpop_config(self, model_config) -> KVpopConfig:
        """The checkpoint's config: KVpop on the full-attention layers (the sliding-window and linear-attention
        layers of a hybrid keep their own cache, docs/hybrid_models.md), which ``layers`` lists."""
        layers, heads, head_dim = model_shape(model_config)
        fields = config_layer_fields(layer_plan(model_config, "window"))
        return KVpopConfig(sinks=self.sinks, window=self.window, topk=self.topk, scorer=self.scorer,
                           scorer_kwargs=json.loads(self.scorer_kwargs), log_gamma=self.log_gamma,
                           decay_step=self.decay_step, num_layers=layers, num_kv_heads=heads, head_dim=head_dim,
                           **fields,
                           base_model=getattr(model_config, "_name_or_path", None) or None)


def _backends_given(value, target_reduce: str) -> dict:
    """``KVpopTrainingArguments.backends`` (a Backends, a dict of its fields, a JSON object or None) checked and
    kept as the dict of its given fields (JSON-serialisable, as TrainingArguments are saved)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"backends must be a JSON object of kvpop_hf.Backends fields: {err}") from err
    record = Backends.coerce(value)
    record.check_target_reduce(target_reduce)
    return record.given()


class KVpopTrainer(DistillationTrainer):
    """A `transformers.Trainer` that retrofits KVpop scorers (and optionally distils the backbone).

    Args:
        model: the causal LM to retrofit (a PEFT LoRA model is supported).
        args: `KVpopTrainingArguments`.
        teacher_model: the frozen dense teacher. Default: the same model with adapters disabled for
            PEFT models, else a frozen deep copy (not needed when ``train_backbone=False``).
        scorer: an existing `Scorer` to continue training (default: a fresh one from ``args``).
        data_args: `kvpop_hf.data.KVpopDataArguments` for a raw `datasets` split given as ``train_dataset`` /
            ``eval_dataset`` (no ``input_ids`` column): prepared as ``training/retrofit.py --dataset`` prepares it,
            one document per row, with ``processing_class`` as the tokenizer.

    Rows of different lengths are padded on the right by `kvpop_hf.data.KVpopDataCollator` (the default
    ``data_collator``); padded positions take no part in the targets, the boundary loss or the distillation.
    The shared sequence (teacher, step order, saves, resuming) is `DistillationTrainer`'s; the scorer (and the
    decay, with ``log_gamma``) are its parts.
    """

    train_attn_implementation = TRAIN_ATTN_NAME

    def __init__(self, model=None, args: KVpopTrainingArguments = None, teacher_model=None, scorer=None,
                 data_args=None, **kwargs):
        if not isinstance(args, KVpopTrainingArguments):
            raise ValueError("KVpopTrainer needs `args=KVpopTrainingArguments(...)`.")
        backends = args.training_backends()  # every choice concrete (and checked) before any work
        from ..data import KVpopDataCollator
        from ..data.prepare import ensure_prepared

        tokenizer = kwargs.get("processing_class")
        for key in ("train_dataset", "eval_dataset"):
            kwargs[key] = ensure_prepared(kwargs.get(key), tokenizer, data_args)
        if kwargs.get("data_collator") is None:
            kwargs["data_collator"] = KVpopDataCollator(getattr(tokenizer, "pad_token_id", None) or 0)
        self.kvpop_config = args.kvpop_config(unwrap_model(model).config)
        cfg = self.kvpop_config
        if scorer is None:
            scorer = build_scorer(cfg.scorer, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, **cfg.scorer_kwargs)
        # the scorer lives inside the model so that optimisers, DDP/FSDP and checkpoints see it
        parts = {SCORER_ATTR: scorer.requires_grad_(True)}
        if args.log_gamma is not None:
            lg = torch.full((cfg.num_layers, cfg.num_kv_heads), float(args.log_gamma))
            parts[LOG_GAMMA_ATTR] = nn.Parameter(lg, requires_grad=args.learn_decay)
        super().__init__(model, args, parts, teacher_model, distil=args.distill_weight > 0,
                         train_backbone=args.train_backbone, **kwargs)
        self.settings = StudentSettings(sinks=args.sinks, window=args.window, topk=args.topk,
                                        decay_step=args.decay_step, omega=args.omega,
                                        boundary_temperature=args.boundary_temperature,
                                        target_lse=args.target_lse, target_agg=args.target_agg,
                                        target_reduce=args.target_reduce, target_queries=args.target_queries,
                                        backends=backends, targets=args.scorer in LEARNED_SCORERS)

    # -- parts --------------------------------------------------------------------------------
    @property
    def scorer(self):
        return self.part(SCORER_ATTR)

    def _log_gamma(self, model):
        return getattr(unwrap_model(model), LOG_GAMMA_ATTR, None)

    def parts_learning_rate(self) -> float | None:
        return self.args.scorer_learning_rate

    # -- the step -------------------------------------------------------------------------------
    def student_pass(self, model, inputs) -> StudentPass:
        ids = inputs["input_ids"]
        self.max_seq_len_seen = max(getattr(self, "max_seq_len_seen", 0), ids.shape[1])
        real = right_padding_mask(inputs.get("attention_mask"))  # [B, S] bool or None (no padding)
        labels = inputs.get("labels")
        if real is not None:  # padded positions are never supervised, whatever the batch's labels hold there
            labels = (ids if labels is None else labels).masked_fill(~real, -100)
        token_mask = supervised_positions(labels)
        if self.args.target_queries == "labels" and token_mask is None:
            raise ValueError("target_queries='labels' needs labels in the batch (the supervised positions).")
        query_mask = token_mask if self.args.target_queries == "labels" else real
        query_mask = query_mask if self.settings.targets else None
        # No full-vocabulary logits: the student returns its final hidden states and the LM head is applied
        # chunk by chunk inside the losses (chunked_distillation.py).
        outputs, record, hidden = student_forward(model, self.scorer, self.settings, self._log_gamma(model),
                                                  query_mask=query_mask, valid_queries=real, return_hidden=True,
                                                  layers=self.kvpop_config.layers, input_ids=ids)
        return StudentPass(outputs, hidden, record, labels, token_mask)

    def training_loss(self, model, student: StudentPass, teacher_hidden):
        args, record = self.args, student.record
        logs = {}  # name -> 0-d tensor, read back in one transfer at the end
        loss = student.hidden.new_zeros((), dtype=torch.float32)
        if self.settings.targets:
            b_loss = torch.stack(list(record.boundary.values())).mean()
            loss = args.boundary_weight * b_loss
            logs["boundary_loss"] = b_loss
        if teacher_hidden is not None:
            d_loss = self.distillation_loss(model, student, teacher_hidden)
            loss = loss + args.distill_weight * d_loss
            logs["distill_loss"] = d_loss
        elif not args.train_backbone and student.labels is not None:
            with torch.no_grad():
                logs["student_lm_loss"] = chunked_lm_loss(student.hidden, *head_weights(lm_head_of(model)),
                                                          student.labels, softcap=final_logit_softcap(model))
        if self.settings.targets:
            logs["target_topk_recall"] = torch.stack(list(record.target_recall.values())).nanmean()
            for li, r in record.target_recall.items():
                logs[f"target_topk_recall/layer_{li}"] = r
            logs["teacher_keep_rate"] = torch.stack(list(record.keep_rate.values())).nanmean()
        return loss, logs

    # -- checkpoints: model files + KVpop files in the same directory -------------------------------
    def save_parts(self, output_dir, parts):
        lg = parts.get(LOG_GAMMA_ATTR)
        hub.save(output_dir, self.kvpop_config, parts[SCORER_ATTR], None if lg is None else lg.detach())
        write_hook(output_dir)  # custom_generate/generate.py: generate with this cache (kvpop_hf/hub_generate.py)

    def load_parts(self, checkpoint_dir):
        _, state, log_gamma = hub.load(checkpoint_dir)
        hub.load_scorer_state(self.scorer, state, checkpoint_dir)
        lg = self._log_gamma(self.model)
        if lg is not None and log_gamma is not None:
            with torch.no_grad():
                lg.copy_(log_gamma)

    def create_model_card(self, **kwargs):
        from .model_card import write_model_card

        if self.is_world_process_zero():
            write_model_card(self, **kwargs)

    def push_to_hub(self, commit_message="End of KVpop retrofit", blocking=True, **kwargs):
        """Saves the model, the scorer and a model card, then uploads them (see `Trainer.push_to_hub`)."""
        return super().push_to_hub(commit_message=commit_message, blocking=blocking, **kwargs)


def right_padding_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """``attention_mask [B, S]`` -> the real positions ``[B, S]`` bool, or None when nothing is padded. Only right
    padding (each row's real tokens first) is accepted: left padding would move the sinks and every token off its
    position (``t`` counts real tokens of one document), so it is refused with the fix named."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    real = attention_mask.bool()
    lengths = real.sum(-1, keepdim=True)
    if not bool((real == (torch.arange(real.shape[1], device=real.device) < lengths)).all()):
        raise ValueError("KVpopTrainer takes right-padded batches (each row's tokens first, padding after them): "
                         "this batch is left-padded or has holes. Use the default collator "
                         "(kvpop_hf.data.KVpopDataCollator) or pad on the right (tokenizer.padding_side='right').")
    if bool((lengths == 0).any()):
        raise ValueError("a row of the batch has no tokens (all padding): drop empty rows from the dataset.")
    return real
