"""lm-evaluation-harness model ``kvpop``: lm-eval's Hugging Face model (``HFLM``) with a fixed-budget KV cache.

Importing this module registers the model; then ``lm_eval.simple_evaluate(model="kvpop", model_args=...)``
works, and the console command ``kvpop-lm-eval`` (:func:`main`) is lm-eval's own command line with the model
registered::

    kvpop-lm-eval --model kvpop --model_args pretrained=Qwen/Qwen3-8B,policy=snapkv,window=64,compression=0.88 \\
        --tasks gsm8k --batch_size 8

``model_args`` are HFLM's (``pretrained``, ``dtype``, ``batch_size``, ``max_length``, ...) plus those of
:mod:`kvpop_hf.integrations.policy_args` (``policy``, ``scorer``, ``sinks``, ``window``, ``topk`` or
``compression``), ``prefill_chunk=N`` (feed prompts in eager chunks of N tokens with :func:`kvpop_hf.prefill_in_chunks`, which
equals ``generate(prefill_chunk_size=N)`` and keeps ``generate``'s compiled decode steps valid on CUDA),
``compile=auto|True|False``, ``batching=continuous|static`` and ``max_rows=R`` (see ``generate_until`` below). On
CUDA ``generate`` compiles the decode step of a fixed-budget cache by itself, once per cache shape (a minute or two each). ``auto`` (the default) lets it when the budget is fixed (``topk=``) and decodes
eagerly with ``compression=``, whose budget follows each prompt's length and would compile a graph per length;
``True`` always lets it, ``False`` never (``generate(disable_compile=True)``). All of them are checked, and a
checkpoint is loaded and matched to the model's shape, before the weights load; an unknown key (neither the kvpop
model's, HFLM's, a ``from_pretrained`` option nor a field of the model's config) is refused with the closest valid one.
``kvpop-lm-eval`` makes these checks before lm-eval starts any work.

* ``generate_until``, ``batching=continuous`` (the default): every request through :func:`kvpop_hf.generate_batch`
  over ``R`` rows of one KVpopCache (``R`` = ``max_rows=``, else lm-eval's batch size), each request with its own
  ``until``, ``max_gen_toks`` and sampling settings, prepared and post-processed as HFLM does (context cut from the
  left to ``max_length - max_gen_toks``, the EOS text added to ``until``, the text cut at the first stop string);
  a row whose request ends takes the next one. Identical requests (lm-eval's ``repeats``) are one prompt: greedy,
  one sequence for all of them; sampled, one prefill forked into ``n`` rows. With ``compression=`` one cache (and
  ``generate_batch`` call) per budget. Policies ``generate_batch`` does not serve (``dense``, the attention-scored
  ``tova``, ``h2o``, ``snapkv``, ``dms``, a model without the ``kvpop`` attention) and requests with a generation
  setting it does not implement (e.g. ``repetition_penalty``) take the static path.
* ``generate_until``, ``batching=static``: HFLM's batching (left padding, greedy or sampled, ``repeats``), each batch
  with a fresh cache passed to ``model.generate``. With ``compression=`` the budget follows each prompt's own
  length, so a batch is split into groups of rows with the same budget (one ``generate`` per group).
* ``loglikelihood``: per context, the context is prefilled exactly as ``generate`` prefills a prompt (one forward,
  or chunks of ``prefill_chunk``) into a fresh cache; then the continuation is fed as ``generate`` would decode it:
  one forward for policies whose logits do not depend on chunking (static priorities under the ``kvpop``
  attention), token by token for the attention-scored ones (TOVA, H2O, SnapKV) and DMS. Continuations that share a
  context share its prefill (a copy of the cache each).
* ``policy=dense`` is HFLM unchanged (same attention implementation, same code paths).
"""

from __future__ import annotations

import copy
import logging
import sys
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm

import kvpop_hf  # noqa: F401  (registers the "kvpop" attention)

from ..compat import with_cache
from ..prefill import prefill_in_chunks
from .policy_args import PolicyArgs, parse_policy_args

__all__ = ["KVpopLM", "check_model_args", "main"]

log = logging.getLogger(__name__)


def _compile_choice(value) -> bool | str:
    """``compile=`` as given on lm-eval's command line (a bool or a string) -> True, False or "auto"."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("auto", "", "none"):
        return "auto"
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise ValueError(f"kvpop model_args: compile={value!r} is not auto, True or False (auto: compile the decode step "
                     "on CUDA when the budget is fixed, topk=; eager with compression=).")


def _adapter_base(pretrained) -> str | None:
    """The base model of a local PEFT adapter folder (``adapter_config.json`` and no ``config.json``), else None."""
    import json
    from pathlib import Path

    if not isinstance(pretrained, str):
        return None
    folder = Path(pretrained)
    if (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file():
        return json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
    return None


def _model_config(pretrained, revision, trust_remote_code, subfolder):
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(pretrained, str):
        return AutoConfig.from_pretrained(pretrained, revision=revision or "main", trust_remote_code=bool(trust_remote_code),
                                          subfolder=subfolder or "")
    config = getattr(pretrained, "config", None)
    if not isinstance(config, PretrainedConfig):
        raise ValueError(f"kvpop model_args: pretrained must be a model folder, a Hub id or a PreTrainedModel, got "
                         f"{type(pretrained).__name__}.")
    return config


# model_args of the kvpop model itself (HFLM's come from its signature)
KVPOP_ARGS = ("pretrained", "policy", "scorer", "sinks", "window", "topk", "compression", "prefill_chunk", "compile",
              "batching", "max_rows")
# options of from_pretrained (and of its quantization) that HFLM hands on through its **kwargs
MODEL_LOAD_ARGS = ("attn_implementation", "device_map", "max_memory", "low_cpu_mem_usage", "torch_dtype", "variant",
                   "offload_buffers", "offload_state_dict", "key_mapping", "use_kernels", "experts_implementation",
                   "adapter_name", "adapter_kwargs", "generation_config", "tp_size", "device_mesh", "load_in_8bit",
                   "load_in_4bit", "bnb_4bit_compute_dtype", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant")


def _signature_args(fn) -> set[str]:
    import inspect

    return {n for n, p in inspect.signature(fn).parameters.items()
            if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def check_arg_names(names, model_config) -> None:
    """Every ``model_args`` key is the kvpop model's, HFLM's, a ``from_pretrained`` option or a field of the model's
    config (which ``from_pretrained`` sets); else a ValueError naming the closest valid key and listing them."""
    import difflib

    from transformers import PreTrainedModel

    hflm = _signature_args(HFLM.__init__) | _signature_args(HFLM._create_model)
    loading = (set(MODEL_LOAD_ARGS) | _signature_args(PreTrainedModel.from_pretrained)) - hflm - set(KVPOP_ARGS) \
        - {"pretrained_model_name_or_path", "config"}  # HFLM passes these itself
    fields = set(model_config.to_dict()) if model_config is not None else set()
    valid = set(KVPOP_ARGS) | hflm | loading
    unknown = [n for n in names if n not in valid and n not in fields]
    if not unknown:
        return
    close = {n: difflib.get_close_matches(n, sorted(valid | fields), n=1) for n in unknown}
    guess = "; ".join(f"{n}= (did you mean {c[0]}=?)" if c else f"{n}=" for n, c in close.items())
    raise ValueError(f"kvpop model_args: unknown argument {guess}. Valid: the kvpop model's "
                     f"{', '.join(KVPOP_ARGS)}; HFLM's {', '.join(sorted(hflm - set(KVPOP_ARGS)))}; the model loading "
                     f"options {', '.join(sorted(loading))}; or a field of the model's config.json.")


def _batching_choice(value) -> str:
    """``batching=`` as given: ``continuous`` (default) or ``static``."""
    text = "continuous" if value is None else str(value).strip().lower()
    if text in ("", "continuous"):
        return "continuous"
    if text == "static":
        return "static"
    raise ValueError(f"kvpop model_args: batching={value!r} is not continuous or static (continuous: generate_until "
                     "through kvpop_hf.generate_batch; static: lm-eval's own batches through model.generate).")


def _checked_args(pretrained, kwargs: dict, policy="kvpop", scorer=None, sinks=None, window=None, topk=None,
                  compression=None, prefill_chunk=None, compile="auto", batching=None, max_rows=None):
    """Every check of the kvpop model's ``model_args``, made before any weights load: ``(base model of a LoRA folder
    or None, PolicyArgs, prefill_chunk, compile, batching, max_rows)``. ``kwargs`` (HFLM's arguments) gets ``peft``
    for a LoRA folder and ``attn_implementation="kvpop"`` for a compressing policy."""
    from .policy_args import _as_int

    base = _adapter_base(pretrained)
    if base is not None:  # a LoRA student folder: HFLM loads its base model with peft=, the folder is the checkpoint
        if kwargs.get("peft") not in (None, pretrained):
            raise ValueError(f"kvpop model_args: pretrained={pretrained} is a PEFT adapter folder; drop peft=.")
        kwargs["peft"] = pretrained
    config = _model_config(base or pretrained, kwargs.get("revision"), kwargs.get("trust_remote_code"),
                           kwargs.get("subfolder"))
    check_arg_names(kwargs, config)
    kv = parse_policy_args(config, pretrained if isinstance(pretrained, str) else None, policy, scorer, sinks, window,
                           topk, compression)
    chunk = _as_int("prefill_chunk", prefill_chunk, 1)
    choice = _compile_choice(compile)
    batch = _batching_choice(batching)
    rows = _as_int("max_rows", max_rows, 1)
    if rows is not None and batch == "static":
        raise ValueError(f"kvpop model_args: max_rows={rows} sets the rows of batching=continuous; with "
                         "batching=static lm-eval's --batch_size sets the batch.")
    attn = kwargs.get("attn_implementation")
    if not kv.dense:
        if attn is None and isinstance(pretrained, str):
            kwargs["attn_implementation"] = "kvpop"  # every query of a prompt chunk sees exactly its own set
        elif attn not in (None, "kvpop") and not kv.chunk_exact:
            raise ValueError(f"kvpop model_args: policy={policy} scores entries from the attention and needs "
                             f"attn_implementation=kvpop; drop attn_implementation={attn}.")
    return base, kv, chunk, choice, batch, rows


def check_model_args(model_args: dict) -> PolicyArgs:
    """The kvpop model's ``model_args`` (a dict, as lm-eval parses them) checked as the model checks them, without
    loading any weights; ``kvpop-lm-eval`` calls it before lm-eval starts its work."""
    args = dict(model_args)
    if args.get("pretrained") in (None, ""):
        raise ValueError("kvpop model_args: pretrained= (a model folder or Hub id) is missing.")
    own = {k: args.pop(k) for k in KVPOP_ARGS[1:] if k in args}
    return _checked_args(args.pop("pretrained"), args, **own)[1]


@register_model("kvpop")
class KVpopLM(HFLM):
    """HFLM with a KVpop (or baseline) cache per request; see the module docstring for ``model_args``."""

    def __init__(self, pretrained, policy: str = "kvpop", scorer: str | None = None, sinks=None, window=None,
                 topk=None, compression=None, prefill_chunk=None, compile="auto", batching=None, max_rows=None,
                 **kwargs):
        base, self.kv, self.prefill_chunk, self.compile, self.batching, self.max_rows = _checked_args(
            pretrained, kwargs, policy, scorer, sinks, window, topk, compression, prefill_chunk, compile, batching,
            max_rows)
        attn = kwargs.get("attn_implementation")
        # a stock attention shows a chunk all of its own tokens: then only token-by-token decoding is exact
        self._chunk_exact = self.kv.chunk_exact and attn in (None, "kvpop")
        super().__init__(base or pretrained, **kwargs)
        if self.backend != "causal":
            raise ValueError("kvpop model_args: KV-cache eviction applies to decoder-only models; use backend=causal.")
        if not self.kv.dense and not isinstance(pretrained, str):
            impl = getattr(self.model.config, "_attn_implementation", None)
            if impl != "kvpop":
                self.model.set_attn_implementation("kvpop")
        log.info("kvpop: %s", self.kv.describe())
        # why generate_until cannot go through generate_batch (None: it can)
        self._static_reason = self._static_because()
        if self.batching == "continuous" and self._static_reason is not None:
            log.info("kvpop: generate_until runs in static batches (model.generate): %s", self._static_reason)

    # -- metadata ------------------------------------------------------------------------------------
    def get_model_info(self) -> dict:
        info = super().get_model_info()
        info["kvpop"] = self.kv.describe()
        return info

    def _warn_short(self) -> None:
        if self.kv.short_requests:
            log.warning("kvpop: %d request budgets were too small for compression=%s to leave long-range slots after "
                        "sinks=%d + window=%d; those requests kept sinks + window.", self.kv.short_requests,
                        self.kv.compression, self.kv.sinks, self.kv.window)
            self.kv.short_requests = 0

    # -- generation ----------------------------------------------------------------------------------
    def _static_because(self) -> str | None:
        """Why this model's ``generate_until`` cannot run through :func:`kvpop_hf.generate_batch` (None: it can)."""
        if self.kv.dense:
            return "policy=dense is HFLM unchanged"
        from ..batch import _check_model_and_cache

        try:
            _check_model_and_cache(self.model, self.kv.make_cache(1 << 20), 1)
        except ValueError as err:
            return str(err)
        return None

    @property
    def continuous(self) -> bool:
        """Whether ``generate_until`` runs through :func:`kvpop_hf.generate_batch` (``batching=continuous``, the
        default, and a policy it serves: a KVpopCache with static priorities under the ``kvpop`` attention)."""
        return self.batching == "continuous" and self._static_reason is None

    def _rows(self) -> int:
        """``R`` of ``generate_batch``: ``max_rows=``, else lm-eval's batch size (``auto``: detected as HFLM does)."""
        if self.max_rows is not None:
            return self.max_rows
        if self.batch_size == "auto":
            return int(self._detect_batch_size())
        return int(self.batch_size)

    def generate_until(self, requests, disable_tqdm: bool = False):
        if self.continuous:
            out = self._generate_until_continuous(requests, disable_tqdm=disable_tqdm)
        else:
            out = super().generate_until(requests, disable_tqdm=disable_tqdm)
        self._warn_short()
        return out

    def _prepare_generation(self, context: str, gen_kwargs: dict, eos: str):
        """One ``generate_until`` request as HFLM prepares it (``normalize_gen_kwargs``, ``until`` with the EOS
        text, the context left-truncated to ``max_length - max_gen_toks``, ``_model_generate``'s temperature rule):
        ``(prompt ids, until, BatchRequest fields, eager)`` (``eager``: the request says ``disable_compile``), or
        None when the request needs a setting ``generate_batch`` does not implement (it then takes lm-eval's static
        path)."""
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

        if not isinstance(gen_kwargs, dict):
            raise ValueError(f"Expected `kwargs` to be of type `dict` but got {type(gen_kwargs)}")
        kwargs = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        max_gen_toks = kwargs.pop("max_gen_toks")
        max_ctx_len = self.max_length - max_gen_toks
        if max_ctx_len <= 0:
            raise ValueError(f"Invalid configuration: requested max tokens to generate ({max_gen_toks}) must be less "
                             f"than model's maximum sequence length ({self.max_length}).")
        # HFLM._model_generate: greedy drops the temperature
        if kwargs.get("do_sample") is False and kwargs.get("temperature", 0.0) == 0.0:
            kwargs.pop("temperature", None)
        eager = bool(kwargs.pop("disable_compile", False))
        if set(kwargs) - {"do_sample", "temperature", "top_k", "top_p", "min_p"}:
            return None  # e.g. max_length, repetition_penalty, num_beams: model.generate
        ids, _ = self.tok_batch_encode([context], left_truncate_len=max_ctx_len, truncation=self.truncation)
        fields = dict(max_new_tokens=max_gen_toks, stop_strings=[u for u in until if u] or None, **kwargs)
        return ids[0].tolist(), until, fields, eager

    def _decode_generation(self, tokens: list[int], until: list[str]) -> str:
        """The generated tokens to text, as HFLM.generate_until post-processes them (thinking tokens, stop
        sequences)."""
        from lm_eval.models.utils import postprocess_generated_text

        think = self.think_end_token
        if isinstance(think, int):
            where = [i for i, t in enumerate(tokens) if t == think]
            if where:
                tokens = tokens[where[-1] + 1:]
        s = self.tok_decode(tokens)
        if isinstance(think, int):
            s = s.lstrip()
        return postprocess_generated_text(generation=s, stop=until,
                                          think_end_token=think if isinstance(think, str) else None)

    def _greedy(self, fields: dict) -> bool:
        do_sample = fields.get("do_sample")
        if do_sample is None:  # as generate resolves it: the model's generation config
            do_sample = bool(getattr(getattr(self.model, "generation_config", None), "do_sample", False))
        return not do_sample

    def _generate_until_continuous(self, requests, disable_tqdm: bool = False) -> list[str]:
        """``generate_until`` through :func:`kvpop_hf.generate_batch`: every request with its own ``until``,
        ``max_gen_toks`` and sampling settings, all through ``R`` rows of one KVpopCache (one per budget with
        ``compression=``), longest prompt first; identical requests (lm-eval's ``repeats``) are one prompt: greedy,
        one sequence given to all of them; sampled, one prefill forked into ``n`` rows (``num_return_sequences``)."""
        import json

        from ..batch import BatchRequest, generate_batch

        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        res: list[str | None] = [None] * len(requests)
        unique: dict[str, dict] = {}  # (context, gen_kwargs) -> its prepared request and the indices asking it
        static: list[int] = []
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            key = json.dumps([context, gen_kwargs], sort_keys=True, default=repr)
            if key in unique:
                unique[key]["indices"].append(i)
                continue
            prepared = self._prepare_generation(context, gen_kwargs, eos)
            if prepared is None:
                static.append(i)
                continue
            ids, until, fields, eager = prepared
            unique[key] = dict(ids=ids, until=until, fields=fields, eager=eager, indices=[i], context=context,
                               gen_kwargs=gen_kwargs)
        if static:
            log.info("kvpop: %d generate_until request(s) need settings generate_batch does not implement; they run "
                     "in static batches (model.generate)", len(static))
            for i, s in zip(static, super().generate_until([requests[i] for i in static], disable_tqdm=disable_tqdm)):
                res[i] = s
        items = sorted(unique.values(), key=lambda u: (-len(u["ids"]), u["context"]))  # HFLM's order: longest first
        groups: dict[Any, list[dict]] = {}
        for u in items:  # one KVpopCache per budget (compression=: the budget follows each prompt's length)
            u["n"] = 1 if self._greedy(u["fields"]) else len(u["indices"])
            groups.setdefault((self.kv.budget(len(u["ids"])), u["eager"]), []).append(u)
        R = self._rows() if groups else 0
        for (_, eager), group in groups.items():
            batch = [BatchRequest(u["ids"], request_id=f"r{j}", num_return_sequences=u["n"], **u["fields"])
                     for j, u in enumerate(group)]
            with torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                                enabled=self.mixed_precision_dtype is not None):
                out = generate_batch(
                    self.model, batch, cache=self.kv.make_cache(len(group[0]["ids"])),
                    max_rows=min(R, sum(u["n"] for u in group)), tokenizer=self.tokenizer,
                    prefill_chunk_size=self.prefill_chunk or max(len(u["ids"]) for u in group),
                    compile=None if self._compiles() and not eager else False,
                    progress_bar=not disable_tqdm and self.rank == 0)
            for j, u in enumerate(group):
                texts = [self._decode_generation(out[f"r{j}" if k == 0 else f"r{j}__child#{k}"].generated_tokens,
                                                 u["until"]) for k in range(u["n"])]
                for k, i in enumerate(u["indices"]):
                    res[i] = texts[k % u["n"]]
                    self.cache_hook.add_partial("generate_until", (u["context"], u["gen_kwargs"]), res[i])
        return res

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        if self.kv.dense:
            return super()._model_generate(context, max_length, stop, **generation_kwargs)
        mask = generation_kwargs.pop("attention_mask", None)
        if mask is None:
            mask = torch.ones_like(context)
        lengths = mask.sum(dim=1).tolist()
        groups: dict[Any, list[int]] = {}
        for row, n in enumerate(lengths):  # rows that share a budget share a cache
            groups.setdefault(self.kv.budget(int(n)), []).append(row)
        if not self._compiles():
            generation_kwargs.setdefault("disable_compile", True)
        L = context.shape[1]
        outs: list[tuple[list[int], torch.Tensor]] = []
        for rows in groups.values():
            n_max = max(int(lengths[r]) for r in rows)
            cut = L - n_max  # padding columns every row of the group has
            ctx, m = context[rows, cut:], mask[rows, cut:]
            cache = self.kv.make_cache(n_max)
            if self.prefill_chunk is not None and ctx.shape[1] > self.prefill_chunk:
                # eager chunks, then generate forwards the last prompt token (its compiled decode steps stay valid)
                prefill_in_chunks(self.model, cache, ctx, self.prefill_chunk, attention_mask=m)
            out = super()._model_generate(ctx, max_length - cut, stop, attention_mask=m,
                                          **with_cache(self.model, cache, **dict(generation_kwargs)))
            if cut:
                pad = torch.full((out.shape[0], cut), self.tokenizer.pad_token_id, dtype=out.dtype, device=out.device)
                out = torch.cat([pad, out], dim=1)
            outs.append((rows, out))
        if len(outs) == 1:
            return outs[0][1]
        width = max(o.shape[1] for _, o in outs)
        full = torch.full((context.shape[0], width), self.tokenizer.pad_token_id, dtype=context.dtype,
                          device=context.device)
        for rows, out in outs:
            full[rows, :out.shape[1]] = out
        return full

    def _compiles(self) -> bool:
        """Whether ``generate`` may compile its decode step (``compile=`` model arg; ``auto``: fixed budgets only)."""
        return self.kv.compression is None if self.compile == "auto" else self.compile

    # -- loglikelihood -------------------------------------------------------------------------------
    @torch.no_grad()
    def _forward(self, cache, ids: list[int]) -> torch.Tensor:
        """Feed ``ids`` into ``cache``; the log-probabilities of every position ``[len(ids), vocab]`` (float32)."""
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        step = self.prefill_chunk or x.shape[1]
        parts = []
        for s in range(0, x.shape[1], step):
            logits = self.model(input_ids=x[:, s:s + step], **with_cache(self.model, cache, use_cache=True)).logits
            parts.append(F.log_softmax(logits[0].float(), dim=-1))
        return torch.cat(parts)

    def _continuation(self, cache, cont_in: list[int]) -> torch.Tensor:
        """Decode the continuation's tokens as ``generate`` would: one chunk where chunking changes nothing, else
        one token per forward."""
        if not cont_in:
            return torch.empty(0, device=self.device)
        if self._chunk_exact:
            return self._forward(cache, cont_in)
        return torch.cat([self._forward(cache, [t]) for t in cont_in])

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        if self.kv.dense:
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        from ..cache import KVpopCache

        prepared = []
        for i, (_, ctx, cont) in enumerate(requests):
            if not ctx or not cont:
                raise ValueError("loglikelihood request with an empty context or continuation")
            if len(cont) > self.max_length:
                raise ValueError(f"a continuation of {len(cont)} tokens exceeds max_length={self.max_length}")
            inp = (ctx + cont)[-(self.max_length + 1):][:-1]  # HFLM's left truncation
            n_ctx = len(inp) - len(cont) + 1  # context tokens kept; the last one predicts cont[0]
            prepared.append((tuple(inp[:n_ctx]), inp[n_ctx:], cont, i))
        by_ctx: dict[tuple, list] = {}
        for p in prepared:
            by_ctx.setdefault(p[0], []).append(p)
        res: list[tuple[float, bool] | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0,
                   desc="Running loglikelihood requests (kvpop)")
        for ctx_ids, group in by_ctx.items():
            base = self.kv.make_cache(len(ctx_ids))
            last = self._forward(base, list(ctx_ids))[-1:]
            for j, (_, cont_in, cont, i) in enumerate(group):
                if j == len(group) - 1:
                    cache = base
                elif isinstance(base, KVpopCache):
                    cache = copy.deepcopy(base)
                else:  # caches without a deep copy: prefill again
                    cache = self.kv.make_cache(len(ctx_ids))
                    self._forward(cache, list(ctx_ids))
                logp = torch.cat([last, self._continuation(cache, cont_in)])  # [len(cont), vocab]
                target = torch.tensor(cont, device=logp.device)
                ll = float(logp.gather(1, target[:, None]).sum())
                greedy = bool((logp.argmax(-1) == target).all())
                res[i] = (ll, greedy)
                req_str = requests[i][0]
                if req_str is not None:
                    self.cache_hook.add_partial("loglikelihood", req_str, (ll, greedy))
                bar.update(1)
        bar.close()
        self._warn_short()
        return res


def main(argv: list[str] | None = None) -> None:
    """``kvpop-lm-eval``: lm-eval's command line (``lm-eval run ...``, ``lm-eval ls ...``) with ``--model kvpop``;
    the kvpop model's ``--model_args`` are checked (:func:`check_model_args`) before lm-eval starts any work."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    setup_logging()
    parser = HarnessCLI()  # what lm_eval.__main__.cli_evaluate runs, with the check between parsing and running
    args = parser.parse_args()
    if getattr(args, "command", None) == "run" and getattr(args, "model", None) == "kvpop":
        check_model_args(args.model_args or {})
    parser.execute(args)

if __name__ == "__main__":
    main()
