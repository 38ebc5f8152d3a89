"""A decoding loop for ``model.generate(..., custom_generate=run_ahead_sample)`` whose host never waits for the
step it has just queued.

Stock greedy/sampling decoding (``GenerationMixin._sample``) asks the device after every step whether all
rows have finished (``bool(unfinished.max() == 0)``). On CUDA that read blocks the host until the step is done,
so the host's part of the next step -- preparing its inputs, dynamo's guards, the CUDA-graph launch, the
logits processors -- runs while the GPU idles, and a decode step costs host time *plus* device time. With a
fixed-budget cache the device part is a few milliseconds, so the host part is a large share of it.

Here the flag of step ``n`` is copied to pinned host memory without blocking and read one step later, after
step ``n + 1`` has been queued: the host waits only for step ``n``, while the GPU already runs ``n + 1``, and a
step costs ``max(host, device)``. The stop at ``max_length`` is known on the host and taken without any extra
step. When the rows stop on their own (EOS, stop strings), the stop is seen one step late: that extra step's
token is dropped from what ``generate`` returns, so ``sequences`` (and ``scores``/``logits``) equal the stock
loop's, and the cache has read one more token: the last token of ``sequences``. ``cache.get_seq_length()``
counts it, so a later ``generate`` on ``sequences`` plus new text feeds exactly the tokens after it -- the
state a stock loop reaches after the first token of that later call (docs/generation.md).

Works with any cache (``KVpopCache``, ``DynamicCache``, ``StaticCache``) and with transformers' automatic
compilation of the decode step. Not supported (a ``ValueError`` before any work names the fix): encoder-decoder
models, ``synced_gpus``, and ``output_attentions`` / ``output_hidden_states`` in the returned dict. A streamer
is passed as ``stream_to=`` (see :func:`run_ahead_sample`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .compat import cache_kwarg

__all__ = ["run_ahead_sample"]


def run_ahead_sample(model, input_ids: torch.LongTensor, logits_processor, stopping_criteria, generation_config,
                     synced_gpus: bool = False, stream_to=None, **model_kwargs: Any):
    """Greedy or multinomial decoding with the stop check read one step late (module docstring).

    Called by ``model.generate(..., custom_generate=run_ahead_sample)`` with generate's prepared arguments:
    ``input_ids`` ``[batch, prompt]`` (left-padded), ``logits_processor`` / ``stopping_criteria`` lists,
    ``generation_config``, ``model_kwargs`` (``attention_mask``, the cache, ``use_cache``...). Returns
    ``sequences`` ``[batch, prompt + new]`` or, with ``return_dict_in_generate``, a
    ``GenerateDecoderOnlyOutput`` with ``sequences``, ``scores`` / ``logits`` if asked, and the cache.

    ``stream_to``: a streamer (``TextStreamer``, ``TextIteratorStreamer``...) given as ``generate(...,
    stream_to=streamer)``: transformers does not forward ``streamer=`` to a custom decoding method. It receives
    the prompt, then each token one step late (the host reads tokens only once their step is done).
    """
    _check_supported(model, generation_config, synced_gpus)
    streamer = stream_to
    if streamer is not None:
        streamer.put(input_ids.cpu())
    keep_scores = generation_config.return_dict_in_generate and generation_config.output_scores
    keep_logits = generation_config.return_dict_in_generate and generation_config.output_logits
    scores: tuple | None = () if keep_scores else None
    raw_logits: tuple | None = () if keep_logits else None
    pad = generation_config._pad_token_tensor
    pad = pad.to(input_ids.device) if pad is not None else None
    has_eos = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    max_length = getattr(stopping_criteria, "max_length", None)
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
    flags = _StopFlags(input_ids.shape[0], input_ids.device)

    forward = (model.get_compiled_call(generation_config.compile_config)
               if model._valid_auto_compile_criteria(model_kwargs, generation_config) else model.__call__)
    outputs = model._prefill(input_ids, generation_config, model_kwargs)
    optimize = getattr(model, "_optimize_model_for_decode", contextlib.nullcontext)
    steps, one_late = 0, False
    with optimize():
        while True:
            if steps:
                model_inputs = model.prepare_inputs_for_generation(
                    input_ids, next_sequence_length=1 if model_kwargs.get("use_cache", True) else None,
                    **model_kwargs)
                outputs = forward(**model_inputs, return_dict=True)
            steps += 1
            model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs, is_encoder_decoder=False)
            logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32, device=input_ids.device)
            del outputs
            step_scores = logits_processor(input_ids, logits)
            if keep_scores:
                scores += (step_scores,)
            if keep_logits:
                raw_logits += (logits,)
            if generation_config.do_sample:
                tokens = torch.multinomial(nn.functional.softmax(step_scores, dim=-1), num_samples=1).squeeze(1)
            else:
                tokens = torch.argmax(step_scores, dim=-1)
            if has_eos:  # finished rows take the padding token
                tokens = tokens * unfinished + pad * (1 - unfinished)
            input_ids = torch.cat([input_ids, tokens[:, None]], dim=-1)
            unfinished = unfinished & ~stopping_criteria(input_ids, scores)
            # queue this step's flag and tokens, then wait for the previous step's (the GPU runs this one meanwhile)
            previous_done, previous_tokens = flags.push(unfinished, tokens if streamer is not None else None)
            if previous_tokens is not None:
                streamer.put(previous_tokens)
            if previous_done:  # every row had stopped one step ago: this step is the extra one
                one_late = True
                break
            if max_length is not None and input_ids.shape[1] >= max_length:
                break
    last_tokens = flags.finish()
    if one_late:  # undo the extra step in what is returned (its token was never streamed)
        input_ids = input_ids[:, :-1]
        scores = scores[:-1] if scores else scores
        raw_logits = raw_logits[:-1] if raw_logits else raw_logits
    elif streamer is not None:
        streamer.put(last_tokens)
    if streamer is not None:
        streamer.end()
    if not generation_config.return_dict_in_generate:
        return input_ids
    fields = GenerateDecoderOnlyOutput.__dataclass_fields__
    cache_field = "cache" if "cache" in fields else "past_key_values"
    return GenerateDecoderOnlyOutput(sequences=input_ids, scores=scores, logits=raw_logits,
                                     **{cache_field: model_kwargs.get(cache_kwarg(model))})


class _StopFlags:
    """Two pinned host slots, used in turn: ``push`` copies this step's "all rows finished" flag (and its tokens,
    for a streamer) without blocking, then waits only for the previous step's copy and returns it."""

    def __init__(self, batch: int, device: torch.device):
        pinned = device.type == "cuda"
        self.slots = [(torch.zeros((), dtype=torch.bool, pin_memory=pinned),
                       torch.zeros(batch, dtype=torch.long, pin_memory=pinned),
                       torch.Event(device=device) if device.type != "cpu" else None) for _ in range(2)]
        self.turn, self.pushed = 0, 0

    def push(self, unfinished: torch.Tensor, tokens: torch.Tensor | None) -> tuple[bool, torch.Tensor | None]:
        done, token_buf, event = self.slots[self.turn]
        done.copy_(unfinished.max() == 0, non_blocking=True)
        if tokens is not None:
            token_buf.copy_(tokens, non_blocking=True)
        if event is not None:
            event.record()
        self.turn ^= 1
        self.pushed += 1
        if self.pushed == 1:
            return False, None
        return self._read(self.turn, tokens is not None)

    def _read(self, turn: int, with_tokens: bool) -> tuple[bool, torch.Tensor | None]:
        done, token_buf, event = self.slots[turn]
        if event is not None:
            event.synchronize()
        return bool(done), (token_buf.clone() if with_tokens else None)

    def finish(self) -> torch.Tensor:
        """Waits for the last push; returns its tokens (meaningful only if tokens were pushed)."""
        return self._read(self.turn ^ 1, True)[1]


def _check_supported(model, generation_config, synced_gpus: bool) -> None:
    problems = []
    if getattr(model.config, "is_encoder_decoder", False):
        problems.append("encoder-decoder models")
    if synced_gpus:
        problems.append("synced_gpus=True (DeepSpeed ZeRO-3 / FSDP generation)")
    if generation_config.return_dict_in_generate and (generation_config.output_attentions
                                                      or generation_config.output_hidden_states):
        problems.append("output_attentions / output_hidden_states")
    if getattr(generation_config, "is_assistant", False):
        problems.append("use as an assistant model")
    if problems:
        raise ValueError(f"run_ahead_sample does not support {', '.join(problems)}; call model.generate without "
                         "custom_generate=run_ahead_sample for these (the stock loop reads the stop flag every step).")
