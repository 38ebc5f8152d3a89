"""Fill the model card template for a KVpopTrainer run and write it as README.md.

The template ships inside the package (``kvpop_hf/trainer/model_card_template.md``, package data), so
an installed wheel can build cards; ``model_cards/README.md`` in the repository points to it."""

from __future__ import annotations

import json
import os
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parent / "model_card_template.md"


def _last_logged(history: list[dict], key: str):
    for entry in reversed(history):
        if key in entry:
            return entry[key]
    return None


def render_model_card(config, *, model_name: str, repo: str, dataset: str, steps: int, history: list[dict],
                      ref_len: int | None = None, quality: dict | None = None, target: str | None = None,
                      model_repo: str | None = None) -> str:
    """``target``: what the scorer was trained to rank by (e.g. the future-attention statistic), shown as is.
    ``model_repo``: where the model weights load from, when not from ``repo`` (a scorer-only checkpoint: the base
    model)."""
    if not TEMPLATE.is_file():
        raise FileNotFoundError(f"Model card template {TEMPLATE} is missing: the kvpop-hf installation is "
                                "incomplete; reinstall it (pip install --force-reinstall kvpop-hf).")
    rows = dict(quality or {})
    for key in ("boundary_loss", "distill_loss", "target_topk_recall", "teacher_keep_rate"):
        value = _last_logged(history, key)
        if value is None and key == "target_topk_recall":
            value = _last_logged(history, "topk_recall")  # key of older kvpop-hf logs
        if value is not None and key not in rows:
            rows[key] = round(float(value), 4)
    quality_md = "\n".join(["| metric | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows.items()])
    compression = f"{1 - config.budget / ref_len:.0%} of the KV cache removed" if ref_len else "n/a"
    return TEMPLATE.read_text().format(
        model_name=model_name, repo=repo, model_repo=model_repo or repo,
        model_note="  # the unchanged base model: this repo holds the scorer only" if model_repo else "",
        base_model=config.base_model or "unknown", budget=config.budget,
        sinks=config.sinks, window=config.window, topk=config.topk, scorer=config.scorer,
        scorer_desc=(f"a learned **{config.scorer}** scorer" if config.scorer in ("mlp", "mlstm") else
                     f"the fixed **{config.scorer}** scorer (backbone distilled at this budget)"),
        scorer_kwargs=json.dumps(config.scorer_kwargs) if config.scorer_kwargs else "",
        decay="none" if config.log_gamma is None else f"log gamma = {config.log_gamma}, step {config.decay_step}",
        ref_len=ref_len or "n/a", compression=compression, dataset=dataset, steps=steps, target=target or "n/a",
        quality=quality_md if rows else "No quality metrics were recorded.")


def _target_text(args) -> str | None:
    """The future-attention target of a KVpopTrainingArguments run, in words (None for other arguments)."""
    reduce, queries = getattr(args, "target_reduce", None), getattr(args, "target_queries", None)
    if reduce is None:
        return None
    stat = {"mean": "mean (the paper's)", "max": "max"}.get(reduce, f"power mean of order {reduce[1:]} ({reduce})")
    who = "the answer's queries (labels)" if queries == "labels" else "every later query"
    exact = "; exact weights (dense log-sum-exp)" if getattr(args, "target_lse", "sparse") == "dense" else ""
    return f"future attention, {stat} over {who}{exact}"  # default: weights under the student's sparse attention


def _base_model_repo(trainer) -> str | None:
    """The base model a scorer-only run (``train_backbone=False``) leaves unchanged and does not save; None when
    the run saves its own weights."""
    if getattr(trainer.args, "train_backbone", True):
        return None
    return trainer.kvpop_config.base_model or "BASE_MODEL"


def write_model_card(trainer, model_name=None, dataset=None, kvpop_quality=None, reference_length=None, **_):
    out = trainer.args.output_dir
    os.makedirs(out, exist_ok=True)
    name = model_name or Path(out).name
    repo = trainer.args.hub_model_id or name
    ref_len = reference_length or getattr(trainer, "max_seq_len_seen", None)
    if isinstance(dataset, (list, tuple)):
        dataset = ", ".join(map(str, dataset))
    text = render_model_card(trainer.kvpop_config, model_name=name, repo=repo, dataset=dataset or "unspecified",
                             steps=trainer.state.global_step, history=trainer.state.log_history, ref_len=ref_len,
                             quality=kvpop_quality, target=_target_text(trainer.args),
                             model_repo=_base_model_repo(trainer))
    Path(out, "README.md").write_text(text)
