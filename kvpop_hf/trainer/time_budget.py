"""Training for a fixed number of seconds rather than steps.

:class:`TimeBudget` ends training once ``seconds`` have passed since training began (the first step, with any
compilation and warm-up it does, counts; what happens before ``Trainer.train`` starts its loop does not).
:func:`time_decay_schedule` is the learning-rate schedule that goes with it: a linear warmup over
``warmup_steps`` steps, then a linear decay to 0 over the *remaining time* of the budget. A step-based
decay cannot do this when the number of steps is unknown: with ``max_steps`` set far above what the
seconds allow, a linear decay over ``max_steps`` leaves the rate almost constant to the end.
"""

from __future__ import annotations

import time

from torch.optim.lr_scheduler import LambdaLR
from transformers import TrainerCallback


class TimeBudget(TrainerCallback):
    """Ends training gracefully once ``seconds`` have passed since training began (``on_train_begin``), checked
    after every optimizer step: the run ends after the first step that finishes past the budget.

    ``clock`` (default :func:`time.monotonic`) is injectable for tests."""

    def __init__(self, seconds: float, clock=time.monotonic):
        if not seconds > 0:
            raise ValueError(f"The training time budget must be > 0 seconds, got {seconds!r}.")
        self.seconds, self.clock, self.start = float(seconds), clock, None

    def elapsed_fraction(self) -> float:
        """Share of the budget spent, in ``[0, 1]`` (0 before training has begun)."""
        if self.start is None:
            return 0.0
        return min(1.0, (self.clock() - self.start) / self.seconds)

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = self.clock()
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if self.start is None:  # used outside Trainer.train: count from the first step's end
            self.start = self.clock()
        if self.clock() - self.start > self.seconds:
            control.should_training_stop = True
        return control


def time_decay_schedule(optimizer, budget: TimeBudget, warmup_steps: int = 0) -> LambdaLR:
    """Learning rate ``base * min(1, step / warmup_steps) * (1 - budget.elapsed_fraction())``.

    The warmup counts steps (as transformers' schedules do); the decay follows the wall clock of ``budget``
    (the time since training began), reaching 0 when the budget is spent. Not reproducible step for step
    across machines of different speed: the rate at a step depends on how long the steps before it took."""
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}.")

    def factor(step: int) -> float:
        warm = 1.0 if warmup_steps == 0 else min(1.0, step / warmup_steps)
        return warm * max(0.0, 1.0 - budget.elapsed_fraction())

    return LambdaLR(optimizer, factor)
