"""TOVA, H2O and SnapKV (attention-based, scores change every step): the cache against a plain-python simulation
of each rule (docs/design.md §7) on random queries, keys and values, token by token, whole prompt, chunked and
left-padded; then real models through `generate`, the stock-attention error and bad options."""

import math
from types import SimpleNamespace

import pytest
import torch

from helpers import distinct_ids, tiny_config, tiny_model
from kvpop_hf import KVpopCache, KVpopConfig
from kvpop_hf.attention import KVpopMaskInfo, kvpop_attention
from kvpop_hf.compat import with_cache

pytestmark = pytest.mark.tier("unit")

POLICIES = ("tova", "h2o", "snapkv")
SNAP = {"obs_window": 3, "kernel_size": 3}


# ---------------------------------------------------------------- the rules, one entry at a time
def _pool(values, kernel, pooling):
    """SnapKV's pooling of a list in position order: zero (avg, counted) or -inf (max) padding."""
    half, out = kernel // 2, []
    for i in range(len(values)):
        win = [values[j] if 0 <= j < len(values) else (0.0 if pooling == "avg" else -math.inf)
               for j in range(i - half, i + half + 1)]
        out.append(max(win) if pooling == "max" else sum(win) / kernel)
    return out


class Simulation:
    """One (row, KV head): the kept positions and their scores, updated by the policy's rule."""

    def __init__(self, policy, s, w, k, obs=3, kernel=3, pooling="avg"):
        self.policy, self.s, self.w, self.k = policy, s, w, k
        self.obs, self.kernel, self.pooling = obs, kernel, pooling
        self.kept, self.score, self.t = set(), {}, 0

    def _probs(self, q_heads, keys, visible, scale):
        """Mean over the group's query heads of softmax(q . k) over ``visible``; plus each head's weights."""
        per_head = []
        for q in q_heads:
            logits = {c: float(q.double() @ keys[c].double()) * scale for c in visible}
            top = max(logits.values())
            z = sum(math.exp(x - top) for x in logits.values())
            per_head.append({c: math.exp(x - top) / z for c, x in logits.items()})
        return {c: sum(p[c] for p in per_head) / len(per_head) for c in visible}, per_head

    def decode(self, q_heads, keys, scale):
        t, s, w = self.t, self.s, self.w
        u = t - w
        if u >= s:  # u leaves the window: it and the long-range entries keep the best k by current score
            long_range = {p for p in self.kept if s <= p <= t - 1 - w} | {u}
            if len(long_range) > self.k:
                self.kept.discard(min(long_range, key=lambda p: (self.score[p], p)))  # ties: the older goes
        self.kept.add(t)
        self.score[t] = -math.inf if self.policy == "snapkv" else 0.0
        mean, per_head = self._probs(q_heads, keys, sorted(self.kept), scale)
        for c, p in mean.items():
            if self.policy == "tova":
                self.score[c] = p
            elif self.policy == "h2o":
                self.score[c] += p
        self.t += 1
        return per_head

    def chunk(self, q_rows, keys, scale):
        """q_rows: the group's query heads of each real token of the chunk, in order."""
        s, w, n = self.s, self.w, len(q_rows)
        cands = sorted(self.kept | set(range(self.t, self.t + n)))
        votes, outs = {c: 0.0 for c in cands}, []
        for j, q_heads in enumerate(q_rows):
            mean, per_head = self._probs(q_heads, keys, [c for c in cands if c <= self.t + j], scale)
            outs.append(per_head)
            counts = {"tova": j == n - 1, "h2o": True, "snapkv": j >= n - self.obs}[self.policy]
            for c, p in mean.items():
                votes[c] += p if counts else 0.0
        if self.policy == "tova":
            score = votes
        elif self.policy == "h2o":
            score = {c: self.score.get(c, 0.0) + votes[c] for c in cands}
        else:
            score = dict(zip(cands, _pool([votes[c] for c in cands], self.kernel, self.pooling)))
        q_end = self.t + n - 1
        eligible = [c for c in cands if s <= c <= q_end - w]
        best = sorted(eligible, key=lambda c: (score[c], c), reverse=True)[: self.k]  # ties: the newer stays
        self.kept = {c for c in cands if c < s or q_end - w < c <= q_end} | set(best)
        self.score = {c: score[c] for c in self.kept}
        self.t += n
        return outs


def simulate(policy, q, k, v, schedule, s, w, topk, valid=None, scale=None, **snap):
    """The simulations ``[b][h]`` after the last call (``.kept``: positions) and the output ``[b, S, Hq, d]``."""
    b, hq, S, d = q.shape
    hkv = k.shape[1]
    G = hq // hkv
    scale = d ** -0.5 if scale is None else scale
    valid = torch.ones(b, S, dtype=torch.bool) if valid is None else valid
    sims = [[Simulation(policy, s, w, topk, **snap) for _ in range(hkv)] for _ in range(b)]
    out = torch.zeros(b, S, hq, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        real = valid[bi].nonzero().flatten().tolist()  # sequence index of real position p: real[p]
        for hi in range(hkv):
            sim, keys = sims[bi][hi], {}
            i = 0
            for n in schedule:
                idx = [j for j in range(i, i + n) if valid[bi, j]]
                for j in idx:
                    keys[real.index(j)] = k[bi, hi, j]
                heads = range(hi * G, (hi + 1) * G)
                if n == 1:
                    rows = [sim.decode([q[bi, g, i] for g in heads], keys, scale)]
                elif idx:
                    rows = sim.chunk([[q[bi, g, j] for g in heads] for j in idx], keys, scale)
                else:
                    rows = []
                for j, per_head in zip(idx, rows):
                    for g, probs in zip(heads, per_head):
                        out[bi, j, g] = sum(p * v[bi, hi, real[c]].double() for c, p in probs.items())
                i += n
    return sims, out


def drive(policy, q, k, v, schedule, s, w, topk, valid=None, heads="kv_head", **snap):
    """Feed the cache layer through `kvpop_attention` (as a model would); kept sets after each call and outputs.
    TOVA runs with ``heads`` (the per-KV-head rule by default, which :func:`simulate` follows head by head)."""
    b, hq, S, d = q.shape
    kwargs = snap if policy == "snapkv" else {"heads": heads} if policy == "tova" else {}
    cfg = KVpopConfig(sinks=s, window=w, topk=topk, scorer=policy, scorer_kwargs=kwargs,
                      num_layers=1, num_kv_heads=k.shape[1], head_dim=d)
    cache = KVpopCache(kvpop_config=cfg)
    module, outs, i = SimpleNamespace(training=False), [], 0
    for n in schedule:
        keys, values = cache.update(k[:, :, i:i + n], v[:, :, i:i + n], 0)
        mask = KVpopMaskInfo(None if valid is None or n == 1 else valid[:, i:i + n], {})
        outs.append(kvpop_attention(module, q[:, :, i:i + n], keys, values, mask, d ** -0.5)[0])
        i += n
    pos = cache.stored_positions(0)
    kept = [[set(pos[bi, hi][pos[bi, hi] >= 0].tolist()) for hi in range(pos.shape[1])] for bi in range(b)]
    return cache, kept, torch.cat(outs, 1)


def random_qkv(b=2, hkv=2, G=2, S=24, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hkv * G, S, d, generator=g), torch.randn(b, hkv, S, d, generator=g),
            torch.randn(b, hkv, S, d, generator=g))


SCHEDULES = {
    "tokens": [1] * 24,
    "whole_then_tokens": [14] + [1] * 10,
    "chunks": [5, 1, 7, 1, 1, 6, 2, 1],
}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("policy", POLICIES)
def test_cache_follows_the_rule(policy, schedule):
    s, w, topk = 2, 3, 4
    q, k, v = random_qkv(seed=len(schedule))
    sizes = SCHEDULES[schedule]
    sims, ref_out = simulate(policy, q, k, v, sizes, s, w, topk, obs=SNAP["obs_window"], kernel=SNAP["kernel_size"])
    cache, kept, out = drive(policy, q, k, v, sizes, s, w, topk, **SNAP)
    for bi in range(q.shape[0]):
        for hi in range(k.shape[1]):
            assert kept[bi][hi] == sims[bi][hi].kept, (bi, hi)
            assert len(kept[bi][hi]) == s + w + topk
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    assert cache.layers[0].keys.shape[2] == s + w + topk  # fixed storage


@pytest.mark.parametrize("policy", POLICIES)
def test_query_blocks_change_nothing(policy, monkeypatch):
    """A chunk's queries taken 3 rows at a time (bounded memory) give the same kept sets and outputs."""
    import kvpop_hf.baselines.attention_policies.scores as scores

    q, k, v = random_qkv(seed=11)
    sizes = [11, 1, 9, 1, 1, 1]
    _, kept, out = drive(policy, q, k, v, sizes, 1, 3, 4, **SNAP)
    monkeypatch.setattr(scores, "QUERY_BLOCK", 3)
    _, kept3, out3 = drive(policy, q, k, v, sizes, 1, 3, 4, **SNAP)
    assert kept3 == kept
    torch.testing.assert_close(out3, out)


@pytest.mark.parametrize("pooling", ["max", "avg"])
def test_snapkv_pooling_and_left_padding(pooling):
    """Left-padded rows (a prompt of 10 and one of 13 real tokens), then decoding; both poolings, kernel 5."""
    s, w, topk, snap = 1, 3, 5, dict(obs_window=4, kernel_size=5, pooling=pooling)
    q, k, v = random_qkv(S=19, seed=3)
    valid = torch.ones(2, 19, dtype=torch.bool)
    valid[0, :3] = False
    sizes = [13] + [1] * 6
    sims, ref_out = simulate("snapkv", q, k, v, sizes, s, w, topk, valid=valid, obs=4, kernel=5, pooling=pooling)
    _, kept, out = drive("snapkv", q, k, v, sizes, s, w, topk, valid=valid, **snap)
    assert kept == [[sim.kept for sim in row] for row in sims]
    torch.testing.assert_close(out.double()[valid], ref_out[valid], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("policy", ["tova", "h2o"])
def test_left_padding(policy):
    s, w, topk = 1, 2, 3
    q, k, v = random_qkv(S=17, seed=5)
    valid = torch.ones(2, 17, dtype=torch.bool)
    valid[1, :4] = False
    sizes = [6, 5] + [1] * 6
    sims, ref_out = simulate(policy, q, k, v, sizes, s, w, topk, valid=valid)
    _, kept, out = drive(policy, q, k, v, sizes, s, w, topk, valid=valid)
    assert kept == [[sim.kept for sim in row] for row in sims]
    torch.testing.assert_close(out.double()[valid], ref_out[valid], atol=1e-5, rtol=1e-5)


class LayerSimulation(Simulation):
    """TOVA with ``heads="layer"`` for one row: one kept set for all KV heads, scored by the latest query's
    probabilities averaged over every query head of the layer. ``q_heads`` / ``keys`` are per KV head: lists of
    the group's queries and of ``{position: key}``."""

    def _probs(self, q_heads, keys, visible, scale):
        means, per_head = [], []
        for q_group, keys_h in zip(q_heads, keys):
            mean, heads = Simulation._probs(self, q_group, keys_h, visible, scale)
            means.append(mean)
            per_head += heads
        return {c: sum(m[c] for m in means) / len(means) for c in visible}, per_head


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_tova_layer_mode_follows_the_rule(schedule):
    """The default TOVA: every KV head of a layer keeps the same positions, those of the rule with the attention
    averaged over all query heads; outputs as the rule's."""
    s, w, topk = 2, 3, 4
    q, k, v = random_qkv(b=2, hkv=3, G=2, seed=len(schedule))
    sizes = SCHEDULES[schedule]
    b, hq, S, d = q.shape
    hkv, G = k.shape[1], hq // k.shape[1]
    ref_out = torch.zeros(b, S, hq, v.shape[-1], dtype=torch.float64)
    sims = []
    for bi in range(b):
        sim, keys, i = LayerSimulation("tova", s, w, topk), [{} for _ in range(hkv)], 0
        for n in sizes:
            for j in range(i, i + n):
                for hi in range(hkv):
                    keys[hi][j] = k[bi, hi, j]
            groups = lambda j: [[q[bi, g, j] for g in range(hi * G, (hi + 1) * G)] for hi in range(hkv)]
            rows = [sim.decode(groups(i), keys, d ** -0.5)] if n == 1 else sim.chunk(
                [groups(j) for j in range(i, i + n)], keys, d ** -0.5)
            for j, per_head in zip(range(i, i + n), rows):
                for g, probs in enumerate(per_head):
                    ref_out[bi, j, g] = sum(p * v[bi, g // G, c].double() for c, p in probs.items())
            i += n
        sims.append(sim)
    _, kept, out = drive("tova", q, k, v, sizes, s, w, topk, heads="layer")
    for bi in range(b):
        assert all(kept[bi][hi] == sims[bi].kept for hi in range(hkv)), bi
        assert len(sims[bi].kept) == s + w + topk
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)


def test_tova_heads_option():
    q, k, v = random_qkv(b=1, hkv=2, G=2, S=20, seed=4)
    _, per_head, _ = drive("tova", q, k, v, [12] + [1] * 8, 1, 2, 3, heads="kv_head")
    assert per_head[0][0] != per_head[0][1]  # these heads decide differently on their own
    with pytest.raises(ValueError, match="'layer'.*'kv_head'"):
        drive("tova", q, k, v, [4], 1, 2, 3, heads="all")


def test_canonical_tova_without_sinks_and_window():
    """s = 0, w = 1: TOVA's own rule (each step drop the entry the latest query attended to least; the query
    sees B entries, itself included), written directly over the whole attention row."""
    q, k, v = random_qkv(b=1, hkv=1, G=3, S=20, seed=7)
    B = 5
    _, kept, _ = drive("tova", q, k, v, [1] * 20, 0, 1, B - 1)
    states = []
    for t in range(20):
        states = states + [t]
        logits = torch.stack([(q[0, :, t] @ k[0, 0, c]) / math.sqrt(8) for c in states], -1)  # [G, n]
        probs = logits.softmax(-1).mean(0)
        if len(states) == B and t < 19:
            states.pop(int(probs.argmin()))
    assert kept[0][0] == set(states)


# ---------------------------------------------------------------- real models
@pytest.mark.parametrize("policy", POLICIES)
def test_generate_with_a_real_model(policy):
    model = tiny_model("qwen3", attn="kvpop")
    ids = distinct_ids(2, 12)
    kw = dict(max_new_tokens=8, do_sample=False)
    big = KVpopCache(model.config, sinks=1, window=2, topk=40, scorer=policy)
    dense = model.generate(ids, **kw)
    torch.testing.assert_close(model.generate(ids, **with_cache(model, big, **kw)), dense)  # B >= length: exact
    small = KVpopCache(model.config, sinks=1, window=2, topk=3, scorer=policy)
    out = model.generate(ids, **with_cache(model, small, **kw))
    assert out.shape == (2, 20)
    for layer in range(2):
        pos = small.stored_positions(layer)
        assert pos.shape[-1] == 6 and bool((pos >= 0).all())
        assert bool((pos.sort(-1).values[..., -2:] == torch.tensor([17, 18])).all())  # the window (last token: 19)


@pytest.mark.parametrize("policy", POLICIES)
def test_stock_attention_is_refused(policy):
    """Caught in the same forward (at the next layer's update) and, for the last layer, at the next call."""
    model = tiny_model("llama", attn="sdpa")
    cache = KVpopCache(model.config, sinks=1, window=2, topk=3, scorer=policy)
    with pytest.raises(ValueError, match="attn_implementation='kvpop'"), torch.no_grad():
        model(distinct_ids(1, 10), **with_cache(model, cache))  # the prompt's forward itself
    one_layer = tiny_model("llama", attn="sdpa", layers=1)
    cache = KVpopCache(one_layer.config, sinks=1, window=2, topk=3, scorer=policy)
    with torch.no_grad():
        one_layer(distinct_ids(1, 10), **with_cache(one_layer, cache))
    with pytest.raises(ValueError, match="attn_implementation='kvpop'"):
        cache.stored_positions(0)


@pytest.mark.parametrize("policy, kwargs, match", [
    ("snapkv", {"obs_window": 0}, "obs_window"), ("snapkv", {"kernel_size": 4}, "odd"),
    ("snapkv", {"pooling": "median"}, "pooling"), ("snapkv", {"kernel_size": 2.0}, "kernel_size"),
    ("tova", {"obs_window": 3}, "scorer_kwargs"), ("h2o", {"decay": 1}, "scorer_kwargs"),
])
def test_bad_options(policy, kwargs, match):
    with pytest.raises(ValueError, match=match):
        KVpopCache(tiny_config(), sinks=1, window=2, topk=3, scorer=policy, scorer_kwargs=kwargs)


@pytest.mark.parametrize("policy", POLICIES)
def test_decay_is_refused(policy):
    with pytest.raises(ValueError, match="log_gamma"):
        KVpopCache(tiny_config(), sinks=1, window=2, topk=3, scorer=policy, log_gamma=-0.1)


def test_registered_for_kvpop_eval():
    from kvpop_hf.policies import POLICIES as REGISTRY

    for name in POLICIES:
        cache = REGISTRY[name].factory(tiny_config(), 1, 2, 3)
        assert cache.kvpop_config.scorer == name and REGISTRY[name].description


def test_beam_search_and_hub_roundtrip(tmp_path):
    """Beam search reorders the scores with the rows; a SnapKV cache's options survive save/load."""
    model = tiny_model("qwen3", attn="kvpop")
    ids = distinct_ids(1, 12)
    cache = KVpopCache(model.config, sinks=1, window=2, topk=3, scorer="h2o")
    out = model.generate(ids, **with_cache(model, cache, max_new_tokens=5, num_beams=2, do_sample=False))
    assert out.shape == (1, 17) and cache.layers[0].prio.shape[0] == 2
    snap = KVpopCache(model.config, sinks=1, window=2, topk=3, scorer="snapkv",
                      scorer_kwargs={"obs_window": 6, "kernel_size": 7, "pooling": "max"})
    snap.save_pretrained(tmp_path)
    back = KVpopCache.from_pretrained(tmp_path, model.config)
    assert type(back.layers[0]).__name__ == "DynamicScoreLayer"
    assert back.scorer.config_dict() == {"obs_window": 6, "kernel_size": 7, "pooling": "max"}


def test_mean_over_heads_by_position_any_dtype():
    """The layer-wide TOVA score: each entry gets the mean over the KV heads that hold its position; empty slots 0;
    bfloat16 values give the float32 result rounded."""
    from kvpop_hf.baselines.attention_policies.policies import mean_over_heads_by_position

    pos = torch.tensor([[[0, 1, 2, -1], [2, 1, 0, 3]]])
    vals = torch.tensor([[[0.1, 0.2, 0.3, 0.9], [0.5, 0.4, 0.7, 0.6]]])
    want = torch.tensor([[[0.4, 0.3, 0.4, 0.0], [0.4, 0.3, 0.4, 0.6]]])
    torch.testing.assert_close(mean_over_heads_by_position(vals, pos), want)
    got = mean_over_heads_by_position(vals.bfloat16(), pos)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want.bfloat16(), atol=1e-2, rtol=0)


@pytest.mark.parametrize("seed", range(4))
def test_mean_over_heads_by_position_matches_a_loop(seed):
    """Random rows (positions shared by some KV heads, far apart, or none; empty slots; no slots) against a plain
    loop over positions."""
    from kvpop_hf.baselines.attention_policies.policies import mean_over_heads_by_position

    g = torch.Generator().manual_seed(seed)
    b, h, C = 3, 4, (0, 1, 7, 16)[seed]
    pos = torch.randint(0, 2 * C + 1, (b, h, C), generator=g) * (10 ** seed)  # sparse and large positions
    pos = torch.where(torch.rand(b, h, C, generator=g) < 0.2, -1, pos)
    vals = torch.rand(b, h, C, generator=g)
    want = torch.zeros(b, h, C)
    for r in range(b):
        for p in pos[r].unique().tolist():
            if p >= 0:
                sel = pos[r] == p
                want[r][sel] = vals[r][sel].mean()
    torch.testing.assert_close(mean_over_heads_by_position(vals, pos), want)
    torch.testing.assert_close(mean_over_heads_by_position(vals, pos.int()), want)
