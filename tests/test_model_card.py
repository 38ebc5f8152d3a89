"""The model card lists the training signals under their current names."""

from kvpop_hf.config import KVpopConfig
from kvpop_hf.trainer.model_card import render_model_card
import pytest

pytestmark = pytest.mark.tier("unit")


def _card(history):
    return render_model_card(KVpopConfig(sinks=4, window=8, topk=4), model_name="m", repo="org/m", dataset="d",
                             steps=3, history=history)


def test_target_topk_recall_row():
    card = _card([{"boundary_loss": 0.5, "target_topk_recall": 0.25}, {"target_topk_recall": 0.75}])
    assert "| target_topk_recall | 0.75 |" in card and "| boundary_loss | 0.5 |" in card


def test_older_log_key_is_read_under_the_new_name():
    card = _card([{"topk_recall": 0.625}])
    assert "| target_topk_recall | 0.625 |" in card and "| topk_recall |" not in card


def test_card_names_the_scorer_target():
    from types import SimpleNamespace

    from kvpop_hf.trainer.model_card import _target_text
    assert _target_text(SimpleNamespace(target_reduce="p4", target_queries="labels")) == \
        "future attention, power mean of order 4 (p4) over the answer's queries (labels)"
    assert _target_text(SimpleNamespace(target_reduce="mean", target_queries="all")) == \
        "future attention, mean (the paper's) over every later query"
    assert _target_text(SimpleNamespace(target_reduce="mean", target_queries="labels", target_lse="dense")) == \
        "future attention, mean (the paper's) over the answer's queries (labels); exact weights (dense log-sum-exp)"
    assert _target_text(SimpleNamespace()) is None
    card = render_model_card(KVpopConfig(sinks=4, window=8, topk=4), model_name="m", repo="org/m", dataset="d",
                             steps=3, history=[], target="future attention, max over every later query")
    assert "| Scorer target | future attention, max over every later query |" in card
    assert "| Scorer target | n/a |" in _card([])
