"""KVpopTrainer on rows of different lengths: the default collator pads on the right, and a padded row trains
exactly as the same row alone (sparse attention, targets, boundary loss, distillation); left padding is refused."""

import pytest
import torch

from helpers import distinct_ids, tiny_model
from kvpop_hf.data import KVpopDataCollator
from kvpop_hf.trainer import KVpopTrainer, StudentSettings, student_forward

from test_trainer import BUDGET
from test_trainer import args as trainer_args

pytestmark = pytest.mark.tier("unit")


def _args(tmp_path, **kw):
    """test_trainer's arguments, two steps."""
    return trainer_args(tmp_path, **{"max_steps": 2, **kw})


def test_collator_pads_on_the_right_with_mask_and_ignored_labels():
    batch = KVpopDataCollator(pad_token_id=7)([{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]},
                                                {"input_ids": [4], "labels": [4]}])
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 7, 7]]
    assert batch["labels"].tolist() == [[-100, 2, 3], [4, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert KVpopDataCollator(0, pad_to_multiple_of=4)([{"input_ids": [1, 2, 3]}])["input_ids"].shape == (1, 4)
    with pytest.raises(ValueError, match="some rows of the batch have labels"):
        KVpopDataCollator()([{"input_ids": [1], "labels": [1]}, {"input_ids": [2]}])
    with pytest.raises(ValueError, match="row 0 .* no tokens"):
        KVpopDataCollator()([{"input_ids": []}])


@pytest.mark.parametrize("backend", ["dense", "flex"])
def test_padded_rows_give_each_real_position_what_the_row_alone_gives(backend):
    model = tiny_model("qwen3")
    model.set_attn_implementation("kvpop_train")
    from kvpop_hf.scorers import build_scorer

    scorer = build_scorer("mlstm", 2, 2, 16, state_dim=8)
    st = StudentSettings(backends={"train_attention": backend}, decay_step=4, **BUDGET)
    rows = [distinct_ids(1, 40, seed=1)[0], distinct_ids(1, 23, seed=2)[0]]
    batch = KVpopDataCollator(0)([{"input_ids": r} for r in rows])
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        out, rec = student_forward(model, scorer, st, query_mask=real, valid_queries=real, input_ids=batch["input_ids"])
        for b, r in enumerate(rows):
            alone, _ = student_forward(model, scorer, st, input_ids=r[None])
            torch.testing.assert_close(out.logits[b, :len(r)], alone.logits[0], atol=2e-5, rtol=0)


@pytest.mark.parametrize("backends", [{}, {"train_attention": "flex", "target_pass": "flex"}])
def test_a_padded_row_trains_as_the_row_alone(tmp_path, backends):
    """compute_loss (boundary loss + distillation, targets over the real queries only) on a row padded to a
    longer batch equals compute_loss on the row alone: CPU defaults (reference sparse attention, chunked target
    pass) and the FlexAttention sparse attention and transposed target pass (the CUDA defaults)."""
    model = tiny_model("qwen3", attn="sdpa")
    trainer = KVpopTrainer(model=model, args=_args(tmp_path, log_gamma=-0.2, decay_step=4, backends=backends),
                           train_dataset=[{"input_ids": distinct_ids(1, 30)[0]}])
    row = distinct_ids(1, 30, seed=3)[0]
    alone = KVpopDataCollator(0)([{"input_ids": row}])
    padded = {k: torch.cat([v, torch.full((1, 17), 0 if k == "input_ids" else (-100 if k == "labels" else 0))], 1)
              for k, v in alone.items()}
    with torch.no_grad():
        expect = trainer.compute_loss(trainer.model, alone)
        logs_alone = {k: v[-1] for k, v in trainer._kvpop_logs.items()}
        got = trainer.compute_loss(trainer.model, padded)
        logs_padded = {k: v[-1] for k, v in trainer._kvpop_logs.items()}
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-5)
    for key in ("boundary_loss", "distill_loss", "target_topk_recall", "teacher_keep_rate"):
        assert logs_padded[key] == pytest.approx(logs_alone[key], abs=1e-5), key
    assert float(expect) > 0


def test_rows_of_different_lengths_train_with_the_default_collator(tmp_path):
    model = tiny_model("qwen3", attn="sdpa")
    data = [{"input_ids": distinct_ids(1, n, seed=n)[0]} for n in (40, 27, 33, 19)]
    trainer = KVpopTrainer(model=model, args=_args(tmp_path), train_dataset=data)
    assert isinstance(trainer.data_collator, KVpopDataCollator)
    trainer.train()
    assert trainer.state.global_step == 2
    assert all(torch.isfinite(torch.tensor(e["loss"])) for e in trainer.state.log_history if "loss" in e)


def test_left_padding_is_refused_with_the_fix_named(tmp_path):
    model = tiny_model("qwen3", attn="sdpa")
    trainer = KVpopTrainer(model=model, args=_args(tmp_path), train_dataset=[{"input_ids": distinct_ids(1, 30)[0]}])
    ids = distinct_ids(2, 20)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with pytest.raises(ValueError, match="right-padded batches .*KVpopDataCollator"):
        trainer.compute_loss(trainer.model, {"input_ids": ids, "attention_mask": mask})
