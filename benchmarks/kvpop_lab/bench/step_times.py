"""The clock of the generate-call speed benchmarks: a stopping criterion that records the time after every new token.
torch and transformers only (no kvpop_hf), so a peer library's runner in its own environment times its own
``generate`` the same way (``kvpop_lab.peers.speed_kvpress``, ``kvpop_lab.bench.generate_call_speed``)."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
from transformers import StoppingCriteria

__all__ = ["StepTimes"]


class StepTimes(StoppingCriteria):
    """Records the time after each generated token (after a device synchronisation); never stops generation.

    ``profile_at``: tokens after which a torch.profiler records three decode steps (``profile``: its table).
    ``sync_all=False`` (run-ahead rows): only the first two tokens synchronise; later times are host times, which
    the run-ahead loop keeps one step ahead of the device (it waits for step ``n - 1`` while ``n`` runs), so their
    gaps are the steady-state step time without adding the synchronisation the loop removes.
    ``on_token``: ``{n: callable}`` run right after the ``n``-th token's time is taken (e.g. handing the device
    to other processes between the prefill and the decode steps). On CUDA the peak of allocated memory up to the
    first token is kept in ``prefill_peak`` (bytes) and the peak counter is reset there, so
    ``torch.cuda.max_memory_allocated`` at the end is the decode steps' peak alone."""

    PROFILED_STEPS = 3

    def __init__(self, device: torch.device, profile_at: int | None = None, sync_all: bool = True,
                 on_token: dict[int, Callable[[], None]] | None = None):
        self.device, self.times, self.sync_all = torch.device(device), [], sync_all
        self.profile_at, self.profile, self._prof = profile_at, None, None
        self.on_token = dict(on_token or {})
        self.prefill_peak: int | None = None

    def __call__(self, input_ids, scores, **kwargs):
        cuda = self.device.type == "cuda"
        if cuda and (self.sync_all or len(self.times) < 2):
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())
        n = len(self.times)
        if n == 1 and cuda:
            self.prefill_peak = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        if n in self.on_token:
            self.on_token[n]()
        if self.profile_at is not None and n == self.profile_at:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            self._prof = profile(activities=activities)
            self._prof.__enter__()
        elif self._prof is not None and n == self.profile_at + self.PROFILED_STEPS:
            self.stop_profile()
            events = self._prof.key_averages()
            sort = "cuda_time_total" if cuda else "cpu_time_total"
            self.profile = (f"{self.PROFILED_STEPS} decode steps inside generate, sorted by {sort}\n"
                            + events.table(sort_by=sort, row_limit=60) + "\n\nby self CPU time\n"
                            + events.table(sort_by="self_cpu_time_total", row_limit=30))
            self._prof = None
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def stop_profile(self) -> None:
        if self._prof is not None:
            self._prof.__exit__(None, None, None)

    def decode_ms(self, warmup: int) -> float:
        """Median gap in ms between consecutive tokens after the first compiled step (token 2) and ``warmup`` more."""
        t = self.times
        if len(t) < warmup + 3:
            raise ValueError(f"{len(t)} tokens timed: raise --new-tokens above --warmup + 2")
        return 1000 * statistics.median(b - a for a, b in zip(t[1 + warmup:], t[2 + warmup:]))

    def first_step_s(self) -> float:
        """Seconds from the first token to the second: the first decode step, compilation included."""
        return self.times[1] - self.times[0]
