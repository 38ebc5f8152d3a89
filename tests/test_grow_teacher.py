"""kvpop_lab.grow_teacher: a grown teacher computes what its source computes (every new part has a zero output),
the new rows are trainable, and sizes it cannot grow to are refused before any work."""

from __future__ import annotations

import json

import pytest
import torch

from kvpop_lab.grow_teacher import extra_layers, grow, main
from kvpop_lab.testbed import build_tokenizer
from kvpop_lab.tiny_models import tiny_model

pytestmark = pytest.mark.tier("unit")


def _source(seed=0, **overrides):
    return tiny_model("qwen3", attn="sdpa", seed=seed, layers=3, **overrides).float()


def test_extra_layers_spread_evenly():
    assert extra_layers(6, 6) == [0] * 6
    assert extra_layers(6, 12) == [1] * 6
    assert extra_layers(4, 6) == [0, 1, 0, 1]
    assert sum(extra_layers(6, 17)) == 11 and max(extra_layers(6, 17)) - min(extra_layers(6, 17)) <= 1


@pytest.mark.parametrize("sizes", [dict(layers=6), dict(heads=8, kv_heads=4), dict(intermediate=200),
                                   dict(layers=5, heads=8, kv_heads=4, intermediate=256)])
def test_grown_model_has_the_source_logits(sizes):
    src = _source()
    dst = grow(src, seed=1, **sizes)
    ids = torch.randint(0, src.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = src(ids).logits, dst(ids).logits
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    cfg = dst.config
    for k, v in sizes.items():
        key = {"layers": "num_hidden_layers", "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
               "intermediate": "intermediate_size"}[k]
        assert getattr(cfg, key) == v
    assert len(cfg.layer_types) == cfg.num_hidden_layers


def test_new_parts_start_at_zero_output_and_copies_keep_the_source():
    src = _source()
    dst = grow(src, layers=6, heads=8, kv_heads=4, intermediate=256, seed=1)
    s_layers, d_layers = src.model.layers, dst.model.layers
    d0 = src.config.num_attention_heads * src.config.head_dim
    for j, layer in enumerate(d_layers):
        i, copy = j // 2, j % 2 == 1  # 3 -> 6: each source layer followed by one copy
        o, down = layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight
        if copy:
            assert o.abs().sum() == 0 and down.abs().sum() == 0
        else:
            assert torch.equal(o[:, :d0], s_layers[i].self_attn.o_proj.weight) and o[:, d0:].abs().sum() == 0
        q = layer.self_attn.q_proj.weight
        assert torch.equal(q[:d0], s_layers[i].self_attn.q_proj.weight)
        assert q[d0:].abs().sum() > 0  # the new heads' rows are random, not zero: they can learn
    assert torch.equal(dst.lm_head.weight, src.lm_head.weight)


def test_grown_model_trains():
    src = _source()
    dst = grow(src, layers=6, heads=8, kv_heads=4, intermediate=256, seed=1).train()
    ids = torch.randint(0, src.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    dst(ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in dst.named_parameters()}
    d0, i0 = src.config.num_attention_heads * src.config.head_dim, src.config.intermediate_size
    assert grads["model.layers.1.self_attn.o_proj.weight"].abs().sum() > 0  # a zero-output copy gets a gradient
    assert grads["model.layers.0.self_attn.o_proj.weight"][:, d0:].abs().sum() > 0  # the new heads' columns
    assert grads["model.layers.0.mlp.down_proj.weight"][:, i0:].abs().sum() > 0  # the new units' columns


@pytest.mark.parametrize("sizes, needle", [
    (dict(layers=2), "below the source's 3"),
    (dict(heads=8, kv_heads=2), "change the group size"),
    (dict(heads=2, kv_heads=1), "below the source's"),
    (dict(intermediate=64), "--intermediate 64 is below"),
])
def test_bad_sizes_are_refused(sizes, needle):
    with pytest.raises(ValueError, match=needle):
        grow(_source(), **sizes)


def test_cli_writes_a_loadable_teacher(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = build_tokenizer()
    src_dir, out = tmp_path / "src", tmp_path / "grown"
    src = _source(vocab_size=len(tok))
    src.save_pretrained(src_dir)
    tok.save_pretrained(src_dir)
    assert main(["--src", str(src_dir), "--out", str(out), "--layers", "4", "--heads", "8", "--kv-heads", "4"]) == 0
    dst = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert dst.config.num_hidden_layers == 4 and len(AutoTokenizer.from_pretrained(out)) == len(tok)
    record = json.loads((out / "grow.json").read_text())
    assert record["src"] == str(src_dir) and record["params"][1] > record["params"][0]
    with pytest.raises(SystemExit, match="change the group size"):
        main(["--src", str(src_dir), "--out", str(tmp_path / "bad"), "--heads", "6", "--kv-heads", "2"])
    assert not (tmp_path / "bad").exists()
    with pytest.raises(SystemExit, match="no config.json"):
        main(["--src", str(tmp_path / "nothing"), "--out", str(tmp_path / "bad")])
