"""The scorer registry: the library's and the baselines' scorers by name, entries given by path imported on first
lookup, a user's scorer registered by name, and bad registrations refused with the fix named."""

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import tiny_config
from kvpop_hf import SCORERS, KVpopCache, build_scorer, register_scorer
from kvpop_hf.baselines.heuristics import StreamingScorer
from kvpop_hf.scorer_registry import ScorerRegistry
from kvpop_hf.scorers import Scorer, scorer_name

pytestmark = pytest.mark.tier("unit")

ROOT = Path(__file__).resolve().parents[1]


class _NormScorer(Scorer):
    def score(self, layer_idx, keys, values, positions):
        return keys.float().norm(dim=-1)


def test_importing_kvpop_hf_registers_the_baselines_without_importing_them():
    code = ("import sys, kvpop_hf\n"
            "names = sorted(kvpop_hf.SCORERS)\n"
            "print(names, sorted(m for m in sys.modules if m.startswith(('kvpop_hf.baselines.', 'kvpop_hf.scorers'))))\n"
            "kvpop_hf.SCORERS['snapkv']\n"
            "print('kvpop_hf.baselines.attention_policies.policies' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    assert lines[0] == ("['h2o', 'keydiff', 'knorm', 'kvp', 'lagkv', 'mlp', 'mlstm', 'random', 'snapkv', "
                        "'streaming', 'tova'] []")
    assert lines[1] == "True"  # imported by the lookup


def test_lookups_resolve_paths_to_the_classes():
    assert SCORERS["streaming"] is StreamingScorer
    assert scorer_name(StreamingScorer(2, 2, 8)) == "streaming"
    assert scorer_name(_NormScorer(2, 2, 8)) == "_NormScorer"  # not registered: the class name
    assert isinstance(build_scorer("knorm", 2, 2, 8), SCORERS["knorm"])


def test_a_registered_scorer_is_usable_by_name():
    try:
        register_scorer("test_norm", _NormScorer)
        assert SCORERS.name_of(_NormScorer) == "test_norm"
        cache = KVpopCache(tiny_config("qwen3", 2), sinks=1, window=2, topk=2, scorer="test_norm")
        assert type(cache.scorer) is _NormScorer
        register_scorer("test_norm", _NormScorer)  # the same target again: accepted
        with pytest.raises(ValueError, match="taken by test_scorer_registry:_NormScorer.*replace=True"):
            register_scorer("test_norm", StreamingScorer)
        register_scorer("test_norm", StreamingScorer, replace=True)
        assert SCORERS["test_norm"] is StreamingScorer
    finally:
        SCORERS.pop("test_norm", None)
    assert "test_norm" not in SCORERS


def test_bad_registrations_are_refused():
    registry = ScorerRegistry()
    with pytest.raises(ValueError, match="package.module:ClassName"):
        registry.register("x", "kvpop_hf.scorers.mlp.MLPScorer")
    with pytest.raises(ValueError, match="Scorer subclass or its 'module:Class' path"):
        registry.register("x", _NormScorer(2, 2, 8))
    with pytest.raises(ValueError, match="non-empty string"):
        registry.register("", _NormScorer)
    registry.register("missing", "kvpop_hf.no_such_module:Nothing")
    with pytest.raises(ImportError, match="'missing' is registered as 'kvpop_hf.no_such_module:Nothing'"):
        registry["missing"]
    with pytest.raises(ValueError, match="Unknown scorer 'nope'.*register_scorer"):
        build_scorer("nope", 2, 2, 8)
