"""kvpop-warm-compile: bad input refused before any model is loaded, and a run on a tiny saved model (CPU, where
generate does not compile: it reports that nothing was cached)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from kvpop_hf import KVpopCache
from kvpop_hf.warm_compile import main

pytestmark = pytest.mark.tier("unit")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    cfg = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.mark.parametrize("argv, message", [
    (["--batches", "0"], "--batches must be positive"),
    (["--new-tokens", "2"], "--new-tokens must be >= 3"),
    (["--window", "0"], "--window 0: .*window"),
    (["--sinks", "-1"], "--sinks -1: .*sinks"),
    (["--topk", "-2"], "--topk -2: .*topk"),
    (["--scorer", "tova"], "not compileable"),
    (["--scorer", "no_such_scorer"], "neither a scorer name"),
])
def test_bad_input_is_refused_first(tmp_path, argv, message):
    with pytest.raises(SystemExit, match=message):
        main(["--model", str(tmp_path / "never_read"), "--cache-dir", str(tmp_path / "cc"), "--device", "cpu", *argv])


def test_budget_triple_names_the_new_flags(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--model", "m", "--cache-dir", str(tmp_path / "cc"), "--device", "cpu", "--budget", "2", "4", "6"])
    assert exc.value.code == 2
    assert "the budget is --sinks S --window W --topk K: pass --sinks 2 --window 4 --topk 6" in capsys.readouterr().err


def test_budget_flags_override_a_checkpoint_one_by_one(tiny_model, tmp_path):
    """A scorer name: 4 + 256 + 3836 but for the flags given; a checkpoint: its own budget but for those."""
    from kvpop_hf.warm_compile import _build_cache

    config = Qwen3Config.from_pretrained(tiny_model)
    KVpopCache(config, sinks=2, window=4, topk=6, scorer="mlp").save_pretrained(tmp_path / "ckpt")
    model = Qwen3ForCausalLM(config)

    def budget(cache):
        return cache.shared.config.sinks, cache.shared.config.window, cache.shared.config.topk

    assert budget(_build_cache(model, "knorm", {})) == (4, 256, 3836)
    assert budget(_build_cache(model, "knorm", {"topk": 7})) == (4, 256, 7)
    assert budget(_build_cache(model, str(tmp_path / "ckpt"), {})) == (2, 4, 6)
    assert budget(_build_cache(model, str(tmp_path / "ckpt"), {"window": 8})) == (2, 8, 6)


def test_cache_dir_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(SystemExit, match="is a file"):
        main(["--model", "m", "--cache-dir", str(tmp_path / "f"), "--device", "cpu"])


def test_warms_each_scorer_and_batch(tiny_model, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    KVpopCache(Qwen3Config.from_pretrained(tiny_model), sinks=2, window=4, topk=6, scorer="mlp").save_pretrained(ckpt)
    assert main(["--model", str(tiny_model), "--cache-dir", str(tmp_path / "cc"), "--device", "cpu", "--dtype",
                 "float32", "--scorer", "knorm", str(ckpt), "--sinks", "2", "--window", "4", "--topk", "6", "--batches",
                 "1", "2"]) == 0
    out = capsys.readouterr()
    lines = [line for line in out.out.splitlines() if " batch " in line]
    assert [line.split(":")[0] for line in lines] == ["knorm batch 1", "knorm batch 2", f"{ckpt} batch 1",
                                                      f"{ckpt} batch 2"]
    assert "nothing will be cached" in out.err and (tmp_path / "cc" / "inductor").is_dir()


def test_compile_mode_reaches_generate(tiny_model, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from kvpop_hf.warm_compile import warm

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    seen = []
    original = model.generate

    def spy(*args, **kwargs):
        seen.append(kwargs.get("compile_config"))
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "generate", spy)
    warm(model, tmp_path / "cc", ["knorm"], [1], sinks=2, window=4, topk=6, progress=False, compile_mode="max-autotune")
    warm(model, tmp_path / "cc", ["knorm"], [1], sinks=2, window=4, topk=6, progress=False)
    warm(model, tmp_path / "cc", ["knorm"], [1], sinks=2, window=4, topk=6, progress=False, compile_mode="max-autotune",
         fuse_projections=True)
    assert seen[0].mode == "max-autotune" and seen[1] is None
    fused = seen[2].options
    assert seen[2].mode is None and fused["max_autotune"] and "post_grad_custom_post_pass" in fused
    assert type(model.model.layers[0].self_attn.k_proj).__name__ == "SharedStorageLinear"


def test_bad_compile_mode_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        main(["--model", "m", "--cache-dir", str(tmp_path / "cc"), "--device", "cpu", "--compile-mode", "fast"])
