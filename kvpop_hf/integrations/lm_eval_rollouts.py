"""pass@1 over n sampled rollouts (the KVpop paper's 16) for any lm-eval generation task.

An lm-eval task with ``repeats: n`` and the ``take_first_k`` filter hands its ``process_results`` all ``n``
generations of a problem as one list; most tasks' ``process_results`` score one generation. :func:`over_rollouts`
turns such a function into one that scores every rollout and reports each metric's mean over the rollouts (pass@1
estimated from ``n`` samples) plus ``pass_at_k`` (1 when the first metric is positive for any rollout). A task file
next to a ``rollouts.py`` holding ``process_results = over_rollouts(<the task's own function>)``::

    include: <lm_eval>/tasks/aime/aime24.yaml
    task: aime24_n16
    repeats: 16
    generation_kwargs: {until: ["Question:", "<|im_end|>"], do_sample: true, temperature: 0.6, top_p: 0.95,
                        max_gen_toks: 32768}
    filter_list: [{name: rollouts, filter: [{function: take_first_k, k: 16}]}]
    process_results: !function rollouts.process_results
    metric_list: [{metric: exact_match, aggregation: mean, higher_is_better: true},
                  {metric: pass_at_k, aggregation: mean, higher_is_better: true}]
"""

from __future__ import annotations

from typing import Callable

__all__ = ["over_rollouts"]


def over_rollouts(score_one: Callable[[dict, list], dict]) -> Callable[[dict, list], dict]:
    """``score_one(doc, [text]) -> {metric: value}`` -> ``process(doc, [[text, ...]] or [text]) -> {metric: mean
    over the rollouts, ..., "pass_at_k": any rollout scores > 0 on the first metric}``."""

    def process(doc: dict, results: list) -> dict:
        outs = results[0] if results and isinstance(results[0], list) else results
        if not outs:
            raise ValueError("no generations to score: the task needs repeats >= 1")
        scores = [score_one(doc, [o]) for o in outs]
        first = next(iter(scores[0]))
        out = {k: sum(float(s[k]) for s in scores) / len(scores) for k in scores[0]}
        out["pass_at_k"] = float(any(float(s[first]) > 0 for s in scores))
        return out

    process.__name__ = f"over_rollouts({getattr(score_one, '__name__', 'process_results')})"
    return process
