"""Continuous batching over the fixed rows of one :class:`~kvpop_hf.cache.KVpopCache` (docs/generate_batch.md).

``generate_batch(model, inputs, generation_config, cache=..., max_rows=R)`` serves many requests through ``R``
rows: a waiting request's prompt is prefilled alone (in chunks) into a batch-1 cache, and that state is copied into
a free row of the ``R``-row cache (:mod:`kvpop_hf.rows`); ``n`` samples of one prompt are one prefill copied into
``n`` rows (a fork). Every decode step runs all ``R`` rows at once, one token each, with fixed shapes (free rows
feed a padding token and their outputs are dropped); a row whose request finishes is refilled before the next step.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

from .compat import with_cache
from . import rows as row_ops

__all__ = ["BatchRequest", "BatchOutput", "generate_batch", "generate_batch_stream"]

# per-request settings generate_batch implements; any other generation option that changes decoding is refused
SAMPLING_FIELDS = ("do_sample", "temperature", "top_k", "top_p", "min_p")
REQUEST_FIELDS = ("max_new_tokens", "eos_token_id", "stop_strings", "num_return_sequences") + SAMPLING_FIELDS
# (field, value that means "off") for options of generate that this loop does not implement
UNSUPPORTED = (("num_beams", 1), ("repetition_penalty", 1.0), ("no_repeat_ngram_size", 0), ("bad_words_ids", None),
               ("min_new_tokens", None), ("min_length", 0), ("typical_p", 1.0), ("epsilon_cutoff", 0.0),
               ("eta_cutoff", 0.0), ("top_h", None), ("forced_bos_token_id", None), ("forced_eos_token_id", None),
               ("suppress_tokens", None), ("begin_suppress_tokens", None), ("sequence_bias", None),
               ("guidance_scale", None), ("exponential_decay_length_penalty", None), ("watermarking_config", None),
               ("renormalize_logits", False), ("remove_invalid_values", False), ("encoder_repetition_penalty", 1.0))
DEFAULTS = dict(max_length=20, do_sample=False, temperature=1.0, top_k=50, top_p=1.0, num_return_sequences=1)


@dataclass
class BatchRequest:
    """One request: its prompt and, where set, its own settings over the batch's generation config. ``seed`` seeds
    the request's own ``torch.Generator`` (sample ``j`` of a forked request uses ``seed + j``)."""

    input_ids: list[int]
    request_id: str | None = None
    max_new_tokens: int | None = None
    seed: int | None = None
    eos_token_id: int | list[int] | None = None
    stop_strings: str | list[str] | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    num_return_sequences: int | None = None


@dataclass
class BatchOutput:
    """The result of one sequence (as transformers' ``GenerationOutput``: ``request_id``, ``prompt_ids``,
    ``generated_tokens``). ``finish_reason``: ``"eos"``, ``"stop_string"`` or ``"length"`` (the stopping token is
    kept, as ``generate`` keeps it). ``logits``: the raw logits of each generated token ``[vocab]`` (float32, CPU)
    when ``output_logits=True``."""

    request_id: str
    prompt_ids: list[int]
    generated_tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    seed: int | None = None
    logits: list[torch.Tensor] | None = None

    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Plan:
    """A request resolved against the batch's settings, checked before any work."""

    request_id: str
    prompt: list[int]
    max_new_tokens: int
    eos: set[int]
    stop_strings: list[str]
    do_sample: bool
    warpers: list
    seeds: list[int | None]  # one per returned sequence


@dataclass
class _Row:
    out: BatchOutput
    plan: _Plan
    generator: torch.Generator | None
    position: int  # real position of ``last``
    last: int  # the row's last token (fed at the next step, at ``position``)
    text_tail: str = ""


@dataclass
class _Group:
    """A prefilled prompt waiting to be copied into rows (more samples than free rows: the rest wait here)."""

    plan: _Plan
    cache: object
    logits: torch.Tensor  # [vocab] float32, the prompt's last-token logits
    next_sample: int = 0


def _resolve(model, generation_config, overrides: dict):
    """The request's GenerationConfig as ``generate`` resolves it: the given one, then unset fields from
    ``model.generation_config``, then transformers' defaults, then this request's own settings."""
    from transformers import GenerationConfig

    gc = copy.deepcopy(generation_config) if generation_config is not None else GenerationConfig()
    base = getattr(model, "generation_config", None)
    defaults = dict(DEFAULTS)
    getter = getattr(GenerationConfig, "_get_default_generation_params", None)
    if getter is not None:
        try:
            defaults.update(getter())
        except TypeError:
            pass
    for source in ((base.to_dict() if base is not None else {}), defaults):
        for key, value in source.items():
            if hasattr(gc, key) and getattr(gc, key) is None and value is not None:
                setattr(gc, key, value)
    for key, value in overrides.items():
        if value is not None:
            setattr(gc, key, value)
    return gc


def _warpers(gc) -> list:
    """The sampling warpers ``generate`` applies (same classes, same order, min_tokens_to_keep 1)."""
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    if not gc.do_sample:
        return []
    out = []
    if gc.temperature is not None and gc.temperature != 1.0:
        out.append(TemperatureLogitsWarper(gc.temperature))
    if gc.top_k is not None and gc.top_k != 0:
        out.append(TopKLogitsWarper(top_k=gc.top_k, min_tokens_to_keep=1))
    if gc.top_p is not None and gc.top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=gc.top_p, min_tokens_to_keep=1))
    if getattr(gc, "min_p", None) is not None:
        out.append(MinPLogitsWarper(min_p=gc.min_p, min_tokens_to_keep=1))
    return out


def _as_request(item, i: int) -> BatchRequest:
    if isinstance(item, BatchRequest):
        req = dataclasses.replace(item)
    elif isinstance(item, torch.Tensor):
        if item.dim() == 2 and item.shape[0] == 1:
            item = item[0]
        if item.dim() != 1:
            raise ValueError(f"inputs[{i}] is a tensor of shape {tuple(item.shape)}; give each prompt as a 1-D "
                             "tensor or a list of token ids.")
        req = BatchRequest(item.tolist())
    elif isinstance(item, (list, tuple)):
        req = BatchRequest(list(item))
    else:
        raise ValueError(f"inputs[{i}] is a {type(item).__name__}; give token id lists, 1-D tensors or BatchRequest.")
    req.input_ids = [int(t) for t in req.input_ids]
    if not req.input_ids:
        raise ValueError(f"inputs[{i}] is an empty prompt: every request needs at least one token.")
    if req.request_id is None:
        req.request_id = f"req_{i}"
    return req


def _plan(model, req: BatchRequest, generation_config, defaults: dict, tokenizer, seed_source) -> _Plan:
    overrides = {k: defaults.get(k) for k in REQUEST_FIELDS}
    overrides.update({k: getattr(req, k) for k in REQUEST_FIELDS if getattr(req, k) is not None})
    gc = _resolve(model, generation_config, overrides)
    bad = []
    for name, off in UNSUPPORTED:
        value = getattr(gc, name, off)
        if value is not None and value != off and not (name == "num_beams" and value == 1):
            bad.append(f"{name}={value!r}")
    if bad:
        raise ValueError(f"generate_batch does not implement {', '.join(bad)} (request {req.request_id}); it "
                         "implements max_new_tokens, eos_token_id, stop_strings, num_return_sequences and sampling "
                         "with temperature, top_k, top_p and min_p. Use model.generate for the others.")
    n = len(req.input_ids)
    max_new = gc.max_new_tokens if gc.max_new_tokens is not None else (gc.max_length or 0) - n
    if not isinstance(max_new, int) or max_new < 1:
        raise ValueError(f"Request {req.request_id} has max_new_tokens={max_new!r} (prompt of {n} tokens): set "
                         "max_new_tokens >= 1.")
    eos = gc.eos_token_id
    eos = set() if eos is None else {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}
    stops = gc.stop_strings
    stops = [] if stops is None else [stops] if isinstance(stops, str) else list(stops)
    if stops and tokenizer is None:
        raise ValueError(f"Request {req.request_id} has stop_strings {stops}: pass tokenizer= to generate_batch "
                         "(the generated text is checked against them).")
    count = gc.num_return_sequences or 1
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"num_return_sequences must be a positive int, got {count!r} (request {req.request_id}).")
    seed = req.seed
    if seed is None and gc.do_sample:
        seed = int(torch.randint(0, 2 ** 62, (), generator=seed_source).item()) if seed_source is not None else int(
            torch.randint(0, 2 ** 62, ()).item())
    seeds = [None if seed is None else seed + j for j in range(count)]
    return _Plan(req.request_id, req.input_ids, max_new, eos, stops, bool(gc.do_sample), _warpers(gc), seeds)


def _check_model_and_cache(model, cache, max_rows):
    from .cache import KVpopCache

    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
        raise ValueError(f"max_rows must be a positive int, got {max_rows!r}.")
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError("generate_batch serves decoder-only models.")
    attn = getattr(model.config, "_attn_implementation", None)
    if attn != "kvpop":
        raise ValueError(f"generate_batch needs the 'kvpop' attention (the model has {attn!r}): load it with "
                         "attn_implementation='kvpop' or call model.set_attn_implementation('kvpop').")
    if cache is None:
        cache = KVpopCache(model.config)
    if not isinstance(cache, KVpopCache):
        raise ValueError(f"generate_batch takes a KVpopCache, got {type(cache).__name__}.")
    if cache.scorer.dynamic or cache.scorer.layer_class is not None:
        raise ValueError(f"The scorer {cache.kvpop_config.scorer!r} re-scores its entries every step: generate_batch "
                         "needs a static-priority scorer that decodes through the fixed-shape step (e.g. 'knorm', "
                         "'mlp', 'mlstm' or a trained checkpoint).")
    if cache.tp_kv_heads is not None:
        raise ValueError("generate_batch does not run under tensor parallelism.")
    row_ops.check_layers(cache)
    rows = row_ops.cache_rows(cache)
    if rows is not None and rows != max_rows:
        raise ValueError(f"The cache holds buffers of batch size {rows} but max_rows={max_rows}: pass a new "
                         "KVpopCache (or one used before with the same max_rows).")
    return cache


def _fresh_like(cache, model):
    """A new, empty cache of the same budget and scorer (the scorer's weights shared)."""
    from .cache import KVpopCache

    new = KVpopCache(model.config, scorer=cache.scorer, kvpop_config=copy.deepcopy(cache.kvpop_config),
                     backends=cache.backends)
    new.log_gamma = cache.log_gamma
    return new


@torch.no_grad()
def _prefill(model, cache, prompt: list[int], chunk: int, device) -> torch.Tensor:
    """All prompt tokens into the empty batch-1 ``cache``, in chunks; returns the last token's logits ``[vocab]``."""
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    n = ids.shape[1]
    logits = None
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        out = model(input_ids=ids[:, start:end], attention_mask=torch.ones(1, end, dtype=torch.long, device=device),
                    position_ids=torch.arange(start, end, device=device)[None],
                    **with_cache(model, cache, use_cache=True, logits_to_keep=1))
        logits = out.logits
    return logits[0, -1].to(copy=True, dtype=torch.float32)


def _sample(logits: torch.Tensor, row: _Row) -> int:
    """One token from ``logits [vocab]`` float32 as ``generate``'s loop picks it for a batch of one."""
    if not row.plan.do_sample:
        return int(torch.argmax(logits))
    scores = logits[None]
    for warper in row.plan.warpers:
        scores = warper(None, scores)
    probs = torch.nn.functional.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, num_samples=1, generator=row.generator)[0, 0])


def generate_batch_stream(model, inputs: Iterable, generation_config=None, *, cache=None, max_rows: int = 8,
                          tokenizer=None, prefill_chunk_size: int = 4096, every_token: bool = False,
                          output_logits: bool = False, compile: bool | None = None, progress_bar: bool = False,
                          seed: int | None = None, **kwargs) -> Iterator[tuple[str, list[int], BatchOutput | None]]:
    """:func:`generate_batch` as a generator: yields ``(request_id, new_tokens, output)``.

    With ``every_token=False`` (default) one item per finished sequence, as it finishes: all its tokens and its
    :class:`BatchOutput`. With ``every_token=True`` also one item per step and running sequence: that step's token
    and ``None`` (the last item of a sequence carries its output). Arguments as :func:`generate_batch`."""
    requests = [_as_request(item, i) for i, item in enumerate(inputs)]
    cache = _check_model_and_cache(model, cache, max_rows)
    if not isinstance(prefill_chunk_size, int) or prefill_chunk_size < 1:
        raise ValueError(f"prefill_chunk_size must be a positive int, got {prefill_chunk_size!r}")
    unknown = set(kwargs) - set(REQUEST_FIELDS)
    if unknown:
        raise ValueError(f"Unknown argument(s) {sorted(unknown)}; per-request settings are {list(REQUEST_FIELDS)} "
                         "(or give BatchRequest objects).")
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
        raise ValueError("request ids must be unique")
    seed_source = torch.Generator().manual_seed(seed) if seed is not None else None
    plans = [_plan(model, r, generation_config, kwargs, tokenizer, seed_source) for r in requests]
    if not plans:
        return
    yield from _run(model, cache, plans, max_rows, tokenizer, prefill_chunk_size, every_token, output_logits,
                    compile, progress_bar, generation_config)


def _run(model, cache, plans, R, tokenizer, chunk, every_token, output_logits, compile, progress_bar,
         generation_config):
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    counts = row_ops.check_layers(cache)
    hybrid = counts["sliding"] > 0
    spare = []  # empty batch-1 caches, reused
    waiting = deque(plans)
    parked: deque[_Group] = deque()
    rows: list[_Row | None] = [None] * R
    set_up = False
    total = sum(len(p.seeds) for p in plans)
    bar = tqdm(total=total, disable=not progress_bar, desc=f"generate_batch ({R} rows)", unit="seq")
    forward = model.__call__
    if compile is None:
        compile = device.type == "cuda" and not getattr(generation_config, "disable_compile", False)
    if compile:
        forward = model.get_compiled_call(getattr(generation_config, "compile_config", None))

    def finish(r: int, reason: str):
        row = rows[r]
        row.out.finish_reason = reason
        rows[r] = None
        bar.update(1)
        return row.out

    def accept(r: int, token: int, logits: torch.Tensor | None):
        """Append ``token`` to row ``r``; returns the stream items it makes."""
        row = rows[r]
        out = row.out
        out.generated_tokens.append(token)
        if output_logits:
            out.logits.append(logits.cpu())
        reason = None
        if token in row.plan.eos:
            reason = "eos"
        elif row.plan.stop_strings:
            row.text_tail = tokenizer.decode(out.generated_tokens[-_tail_tokens(row.plan):])
            if any(s in row.text_tail for s in row.plan.stop_strings):
                reason = "stop_string"
        if reason is None and len(out.generated_tokens) >= row.plan.max_new_tokens:
            reason = "length"
        row.last, row.position = token, row.position + 1
        if reason is not None:
            finish(r, reason)
            return [(out.request_id, [token] if every_token else list(out.generated_tokens), out)]
        return [(out.request_id, [token], None)] if every_token else []

    def start_group(plan: _Plan) -> _Group:
        staging = spare.pop() if spare else _fresh_like(cache, model)
        logits = _prefill(model, staging, plan.prompt, chunk, device)
        return _Group(plan, staging, logits)

    def place(group: _Group, free: list[int]):
        nonlocal set_up
        take = free[:len(group.plan.seeds) - group.next_sample]
        if not set_up:
            row_ops.setup_rows(cache, group.cache, R)
            set_up = True
        row_ops.copy_rows(cache, group.cache, take)
        items = []
        for r in take:
            j = group.next_sample
            group.next_sample += 1
            rid = group.plan.request_id if j == 0 else f"{group.plan.request_id}__child#{j}"
            s = group.plan.seeds[j]
            gen = torch.Generator(device=device).manual_seed(s) if s is not None else None
            out = BatchOutput(rid, list(group.plan.prompt), seed=s, logits=[] if output_logits else None)
            rows[r] = _Row(out, group.plan, gen, position=len(group.plan.prompt) - 1, last=group.plan.prompt[-1])
            items += accept(r, _sample(group.logits, rows[r]), group.logits)
        if group.next_sample == len(group.plan.seeds):
            group.cache.reset()
            spare.append(group.cache)
            return items, True
        return items, False

    try:
        while waiting or parked or any(rows):
            # refill free rows: parked forks first, then waiting requests in order
            while True:
                free = [r for r in range(R) if rows[r] is None]
                if not free or not (parked or waiting):
                    break
                group = parked.popleft() if parked else start_group(waiting.popleft())
                items, done = place(group, free)
                if not done:
                    parked.appendleft(group)
                yield from items
            active = [r for r in range(R) if rows[r] is not None]
            if not active:
                continue
            tokens = torch.tensor([[rows[r].last if rows[r] else 0] for r in range(R)], device=device)
            positions = torch.tensor([rows[r].position if rows[r] else 0 for r in range(R)], device=device)
            extra = {}
            if hybrid:
                extra["attention_mask"] = row_ops.window_mask(cache, positions)
            with torch.no_grad():
                out = forward(input_ids=tokens, position_ids=positions[:, None],
                              **with_cache(model, cache, use_cache=True, logits_to_keep=1), **extra)
            logits = out.logits[:, -1].to(copy=True, dtype=torch.float32)
            del out
            if hybrid:
                row_ops.rewind(cache)
            greedy = logits.argmax(-1).tolist()
            for r in active:
                row = rows[r]
                token = greedy[r] if not row.plan.do_sample else _sample(logits[r], row)
                yield from accept(r, token, logits[r])
    finally:
        bar.close()


def _tail_tokens(plan: _Plan) -> int:
    """How many trailing tokens are decoded for the stop-string check: enough for the longest stop string even at
    one character per token, plus a few for tokens that decode to nothing alone."""
    return max(len(s) for s in plan.stop_strings) + 4


def generate_batch(model, inputs: Iterable, generation_config=None, *, cache=None, max_rows: int = 8,
                   tokenizer=None, prefill_chunk_size: int = 4096, output_logits: bool = False,
                   compile: bool | None = None, progress_bar: bool = True, seed: int | None = None,
                   **kwargs) -> dict[str, BatchOutput]:
    """Generate for many prompts through ``max_rows`` rows of one ``KVpopCache`` (continuous batching).

    Args:
        model: a decoder-only model with ``attn_implementation="kvpop"``.
        inputs: prompts, each a list of token ids, a 1-D tensor, or a :class:`BatchRequest` (its own
            ``max_new_tokens``, ``seed``, ``eos_token_id``, ``stop_strings``, sampling settings,
            ``num_return_sequences``). Served in this order as rows free up.
        generation_config: settings for all requests (a ``GenerationConfig``; unset fields from
            ``model.generation_config``, then transformers' defaults, as ``generate`` resolves them). Keyword
            arguments named as its fields (``max_new_tokens=...``, ``do_sample=...``) override it for all requests.
        cache: an empty ``KVpopCache`` for this model (or one used before with the same ``max_rows``); None: a
            ``KVpopCache(model.config)`` of the default budget.
        max_rows: ``R``, the rows decoded together.
        tokenizer: needed for ``stop_strings``.
        prefill_chunk_size: a prompt is prefilled in chunks of this many tokens.
        output_logits: keep each generated token's raw logits in ``BatchOutput.logits``.
        compile: compile the decode step (``model.get_compiled_call``); None: on CUDA unless the generation config
            says ``disable_compile``.
        progress_bar: a tqdm bar over the sequences.
        seed: seeds the draw of the per-request seeds of sampled requests that set none (None: torch's global RNG).

    Returns:
        ``{request_id: BatchOutput}`` in input order; request ``i`` is ``"req_i"`` unless its ``BatchRequest``
        names it; sample ``j >= 1`` of a request with ``num_return_sequences = n`` is ``"req_i__child#j"``, right
        after its parent.
    """
    requests = [_as_request(item, i) for i, item in enumerate(inputs)]
    results = {}
    for rid, _tokens, out in generate_batch_stream(model, requests, generation_config, cache=cache, max_rows=max_rows,
                                                   tokenizer=tokenizer, prefill_chunk_size=prefill_chunk_size,
                                                   output_logits=output_logits, compile=compile,
                                                   progress_bar=progress_bar, seed=seed, **kwargs):
        results[rid] = out
    ordered = {}
    for req in requests:  # input order, each request's children right after it
        children = sorted((rid for rid in results if rid.startswith(req.request_id + "__child#")),
                          key=lambda rid: int(rid.rpartition("#")[2]))
        for rid in [req.request_id] + children:
            ordered[rid] = results[rid]
    return ordered
