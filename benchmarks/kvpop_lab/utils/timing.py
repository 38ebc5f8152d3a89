"""Timing of one operation for the benchmarks: peak memory of one call, then timed calls.

CUDA: ``torch.cuda.Event`` pairs around each call and ``max_memory_allocated`` minus the allocation
before the call (inputs excluded, outputs included); CPU: ``time.perf_counter`` and no peak (NaN).
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from typing import Any, Callable

import torch

__all__ = ["sync", "free", "compiled_graphs", "measure", "quantiles", "fmt", "is_oom"]


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    """Collect garbage and, on CUDA, return cached blocks so the next peak starts from live tensors."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def compiled_graphs() -> int:
    """Unique graphs dynamo has compiled in this process (-1 if the counter is unavailable)."""
    try:
        from torch._dynamo.utils import counters
        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001  (private counter; names differ across torch versions)
        return -1


def measure(fn: Callable[[], Any], device: torch.device, repeats: int) -> tuple[float, list[float], Any]:
    """``(peak_mib, sorted times in ms, last output)`` of one peak-memory call and ``repeats`` timed calls."""
    cuda = device.type == "cuda"
    peak = math.nan
    if cuda:
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = fn()
        sync(device)
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    times = []
    for _ in range(max(repeats, 1)):
        out = None  # let the previous output go before the next call
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            sync(device)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            out = fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return peak, sorted(times), out


def quantiles(times: list[float]) -> dict[str, float]:
    """``{"median", "p10", "p90"}`` of sorted times (nearest rank for the percentiles)."""
    pick = lambda p: times[min(len(times) - 1, max(0, round(p * (len(times) - 1))))]  # noqa: E731
    return {"median": statistics.median(times), "p10": pick(0.1), "p90": pick(0.9)}


def fmt(x: float | None, nd: int = 2) -> str:
    """A number for a result table: ``nd`` decimals, ``"-"`` for None, NaN and infinities."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{nd}f}"


def is_oom(err: BaseException) -> bool:
    """Whether ``err`` is a device out-of-memory error (a benchmark row records it and goes on)."""
    oom_cls = getattr(torch.cuda, "OutOfMemoryError", None)
    if oom_cls is not None and isinstance(err, oom_cls):
        return True
    msg = str(err).lower()
    return "out of memory" in msg and ("cuda" in msg or "alloc" in msg)
