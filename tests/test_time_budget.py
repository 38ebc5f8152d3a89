"""Training for a time budget: the stop callback, the wall-clock learning-rate decay and the retrofit flags."""

import pytest
import torch
from transformers import TrainerControl

from kvpop_hf.cli import retrofit
from kvpop_hf.trainer.time_budget import TimeBudget, time_decay_schedule

pytestmark = pytest.mark.tier("scripts")


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_budget_stops_after_its_seconds_counted_from_the_start_of_training():
    clock = FakeClock()
    budget = TimeBudget(10, clock=clock)
    assert budget.elapsed_fraction() == 0.0
    clock.now = 500.0  # before Trainer.train begins (model loading, data) does not count
    budget.on_train_begin(None, None, TrainerControl())
    assert budget.elapsed_fraction() == 0.0
    clock.now = 506.0  # the first step (with its compilation) counts
    assert not budget.on_step_end(None, None, TrainerControl()).should_training_stop
    assert budget.elapsed_fraction() == pytest.approx(0.6)
    clock.now = 510.5
    assert budget.on_step_end(None, None, TrainerControl()).should_training_stop
    assert budget.elapsed_fraction() == 1.0


def test_a_first_step_longer_than_the_budget_ends_training():
    clock = FakeClock()
    budget = TimeBudget(10, clock=clock)
    budget.on_train_begin(None, None, TrainerControl())
    clock.now += 30
    assert budget.on_step_end(None, None, TrainerControl()).should_training_stop


def test_without_train_begin_the_clock_starts_at_the_first_step_end():
    clock = FakeClock()
    budget = TimeBudget(10, clock=clock)
    clock.now = 500.0
    assert not budget.on_step_end(None, None, TrainerControl()).should_training_stop
    clock.now = 505.0
    assert budget.elapsed_fraction() == pytest.approx(0.5)


@pytest.mark.parametrize("seconds", [0, -3])
def test_budget_must_be_positive(seconds):
    with pytest.raises(ValueError, match="> 0 seconds"):
        TimeBudget(seconds)


def test_time_decay_warms_up_by_steps_then_decays_with_the_clock():
    clock = FakeClock()
    budget = TimeBudget(100, clock=clock)
    p = torch.nn.Parameter(torch.zeros(()))
    opt = torch.optim.SGD([p], lr=2.0)
    sched = time_decay_schedule(opt, budget, warmup_steps=4)
    budget.on_train_begin(None, None, TrainerControl())
    assert opt.param_groups[0]["lr"] == 0.0  # step 0 of the warmup
    lrs = []
    for _ in range(4):
        budget.on_step_end(None, None, TrainerControl())
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == pytest.approx([0.5, 1.0, 1.5, 2.0])  # the clock has not moved: warmup only
    clock.now += 25
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1.5)
    clock.now += 100
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.0
    with pytest.raises(ValueError, match="warmup_steps"):
        time_decay_schedule(opt, budget, warmup_steps=-1)


def test_retrofit_needs_seconds_for_the_time_decay(tmp_path):
    with pytest.raises(ValueError, match="--max_train_seconds"):  # before loading the (missing) model
        retrofit.main(["--model", str(tmp_path / "missing"), "--output_dir", str(tmp_path / "o"),
                       "--lr_decay_by_time", "True", "--report_to", "none", "--use_cpu", "True"])


def test_retrofit_decays_the_learning_rate_over_its_seconds(tmp_path):
    # 25 s: the first step (setup, first forward) counts and takes several seconds on a small CPU
    from test_streaming_plus import _teacher

    teacher = _teacher(tmp_path)
    trainer = retrofit.train([
        "--model", str(teacher), "--dataset", "testbed:reasoning", "--seq_len", "256", "--sinks", "2",
        "--window", "8", "--topk", "8", "--scorer", "mlp", "--output_dir", str(tmp_path / "o"),
        "--max_steps", "100000", "--num_examples", "4", "--per_device_train_batch_size", "2",
        "--learning_rate", "1e-2", "--max_train_seconds", "25", "--lr_decay_by_time", "True", "--logging_steps", "1",
        "--report_to", "none", "--save_strategy", "no", "--use_cpu", "True", "--disable_tqdm", "True"])
    lrs = [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e]
    assert len(lrs) >= 3 and trainer.state.global_step < 100000  # the seconds ended training
    assert lrs[0] > lrs[-1] and lrs[-1] < 0.5e-2  # decayed over the budget, not over 100000 steps
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_train_dms_needs_seconds_for_the_time_decay(tmp_path):
    from kvpop_hf.cli import train_dms

    with pytest.raises(ValueError, match="--max_train_seconds"):  # before loading the (missing) model
        train_dms.main(["--model", str(tmp_path / "missing"), "--output_dir", str(tmp_path / "o"),
                        "--lr_decay_by_time", "True", "--report_to", "none", "--use_cpu", "True"])
