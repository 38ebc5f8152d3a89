"""Keyword under which a model takes a cache object, across transformers 5.x.

transformers 5.17 calls it ``past_key_values``; newer 5.x releases call it ``cache`` in ``forward`` and
``generate`` and warn (FutureWarning, removal announced for 5.40) when ``past_key_values`` is passed.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

__all__ = ["cache_kwarg", "with_cache"]


def cache_kwarg(model: Any) -> str:
    """``"cache"`` if ``type(model).forward`` has that parameter, else ``"past_key_values"``."""
    return _cache_kwarg_of(type(model))


@functools.lru_cache(maxsize=None)
def _cache_kwarg_of(cls: type) -> str:
    # once per model class: with_cache sits inside decode loops that benchmarks time
    forward = getattr(cls, "forward", None)
    try:
        params = inspect.signature(forward).parameters if forward is not None else {}
    except (TypeError, ValueError):
        params = {}
    return "cache" if "cache" in params else "past_key_values"


def with_cache(model: Any, cache: Any, **kwargs: Any) -> dict:
    """``kwargs`` plus the cache under the keyword this model takes."""
    kwargs[cache_kwarg(model)] = cache
    return kwargs
