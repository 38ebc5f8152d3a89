"""One record of backends (kvpop_hf/backends.py): defaults per device, the environment for defaults only,
clear errors, and end to end: each choice of each backend reaches the code path it names and gives the
reference logits (Triton kernels through the interpreter, float32, on CPU)."""

import warnings

import pytest
import torch

from helpers import distinct_ids, reference_logits, run_chunks, tiny_model
from kvpop_hf import Backends, KVpopCache
from kvpop_hf.backends import CHOICES, env_var

warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture(autouse=True)
def no_backend_environment(monkeypatch):
    for name in CHOICES:
        monkeypatch.delenv(env_var(name), raising=False)


def test_auto_defaults_per_device():
    assert Backends.defaults(CUDA) == Backends(decode_eviction="triton", decode_attention="triton", mlstm_step="triton",
                                               chunk_attention="flex", flex_block_mask="interval",
                                               chunk_cutoff="blocked", flex_dynamic="auto")
    assert Backends().resolve(CPU) == Backends(decode_eviction="torch", decode_attention="torch", mlstm_step="torch",
                                               chunk_attention="dense", flex_block_mask="interval",
                                               chunk_cutoff="blocked", flex_dynamic="auto")


def test_environment_gives_defaults_and_an_explicit_choice_wins(monkeypatch):
    monkeypatch.setenv("KVPOP_DECODE_EVICTION", "Triton")
    monkeypatch.setenv("KVPOP_CHUNK_ATTENTION", "flex")
    resolved = Backends(chunk_attention="dense").resolve(CPU)
    assert (resolved.decode_eviction, resolved.chunk_attention) == ("triton", "dense")
    assert Backends.coerce({"decode_eviction": "torch"}).resolve(CPU).decode_eviction == "torch"


def test_bad_choices_are_refused_naming_the_allowed_values(monkeypatch):
    with pytest.raises(ValueError, match=r"Backends\(decode_eviction=...\) must be one of \('auto', 'torch', 'triton'\)"):
        Backends(decode_eviction="cuda")
    with pytest.raises(ValueError, match="Unknown backends \\['chunk'\\]"):
        Backends.coerce({"chunk": "flex"})
    with pytest.raises(ValueError, match="must be a kvpop_hf.Backends, a dict"):
        Backends.coerce("torch")
    model = tiny_model("qwen3")
    monkeypatch.setenv("KVPOP_FLEX_BLOCK_MASK", "dense")
    with pytest.raises(ValueError, match=r"KVPOP_FLEX_BLOCK_MASK must be one of \('auto', 'interval', 'tiled', 'create'\)"):
        KVpopCache(model.config, sinks=2, window=4, topk=6)  # refused at construction, before any forward
    KVpopCache(model.config, sinks=2, window=4, topk=6, backends={"flex_block_mask": "tiled"})  # explicit wins


def test_triton_off_cuda_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        Backends(decode_attention="triton").resolve(CPU)
    assert Backends(decode_attention="triton").resolve(CUDA).decode_attention == "triton"


def test_triton_missing_is_an_import_error_naming_the_fix(monkeypatch):
    import kvpop_hf.backends as backends

    monkeypatch.setattr(backends, "triton_available", lambda: False)
    assert Backends().resolve(CPU).decode_attention == "torch"  # auto off CUDA needs no triton
    with pytest.raises(ImportError, match=r'pip install "kvpop-hf\[gpu\]".*KVPOP_DECODE_ATTENTION=torch'):
        Backends(decode_attention="triton").resolve(CPU)
    with pytest.raises(ImportError, match=r"kvpop-hf\[gpu\].*KVPOP_CHUNK_CUTOFF=blocked"):
        Backends(chunk_cutoff="triton").resolve(CPU)
    with pytest.raises(ImportError, match=r"kvpop-hf\[gpu\]"):
        Backends().resolve(CUDA)  # auto on CUDA is the Triton kernels


def test_topk_backend_honours_the_device(monkeypatch):
    from kvpop_hf.flex_mask import _topk_backend

    assert _topk_backend(CPU, None) == _topk_backend(CUDA, "auto") == "blocked"
    assert _topk_backend(CPU, "wavelet") == "wavelet"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        _topk_backend(CPU, "triton")
    assert _topk_backend(CUDA, "triton") == "triton"
    with pytest.raises(ValueError, match="chunk_cutoff"):
        _topk_backend(CPU, "fenwick")


def test_not_saved_with_the_config(tmp_path):
    model = tiny_model("qwen3")
    cache = KVpopCache(model.config, sinks=2, window=4, topk=6, backends={"decode_eviction": "torch"})
    cache.save_pretrained(tmp_path)
    assert "backend" not in (tmp_path / "kvpop_config.json").read_text()
    loaded = KVpopCache.from_pretrained(tmp_path, model.config, backends=Backends(chunk_attention="flex"))
    assert loaded.backends == Backends(chunk_attention="flex")


# ---------------------------------------------------------------- end to end: each choice reaches its path
def _spy(monkeypatch, owner, name, calls, tag, check=None):
    original = getattr(owner, name)

    def spy(*args, **kwargs):
        if check is not None:
            check(*args, **kwargs)
        calls.append(tag)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)


def _paths(monkeypatch, field, value):
    """Spies on the functions that ``field=value`` names; returns the list they append to."""
    import kvpop_hf.chunk_attention as chunk_attention
    import kvpop_hf.decode_attention as decode_attention
    import kvpop_hf.decode_eviction as decode_eviction
    import kvpop_hf.flex_compiled as flex_compiled
    import kvpop_hf.flex_mask as flex_mask
    import kvpop_hf.interval_mask as interval_mask
    import kvpop_hf.scorers.mlstm as mlstm
    import kvpop_hf.scorers.mlstm_decode_triton as mlstm_decode_triton
    import kvpop_hf.topk as topk
    from kvpop_hf.layer import ChunkPlan

    calls = []
    if field == "decode_eviction":
        for v, fn in (("torch", "evict_and_insert_reference"), ("triton", "evict_and_insert_triton")):
            _spy(monkeypatch, decode_eviction, fn, calls, v)
    elif field == "decode_attention":
        for v, fn in (("torch", "decode_attention_reference"), ("triton", "decode_attention_triton")):
            _spy(monkeypatch, decode_attention, fn, calls, v)
    elif field == "mlstm_step":
        _spy(monkeypatch, mlstm, "mlstm_step", calls, "torch")
        _spy(monkeypatch, mlstm_decode_triton, "mlstm_decode_priority_triton", calls, "triton")
    elif field == "chunk_attention":
        _spy(monkeypatch, ChunkPlan, "visibility", calls, "dense")
        _spy(monkeypatch, chunk_attention, "flex_chunk_attention", calls, "flex")
    elif field == "flex_block_mask":
        _spy(monkeypatch, interval_mask, "interval_block_mask", calls, "interval")
        _spy(monkeypatch, flex_mask, "build_block_mask", calls, "tiled")
        original = chunk_attention._flex_fns

        def flex_fns(*args):
            flex, make = original(*args)

            def make_spy(*a, **k):
                calls.append("create")
                return make(*a, **k)

            return flex, make_spy

        monkeypatch.setattr(chunk_attention, "_flex_fns", flex_fns)
    elif field == "chunk_cutoff":
        _spy(monkeypatch, flex_mask, "blocked_chunk_cutoff", calls, "blocked")
        original = topk.running_topk

        def running_topk(*args, backend="auto"):
            calls.append(backend)
            return original(*args, backend=backend)

        monkeypatch.setattr(topk, "running_topk", running_topk)
    elif field == "flex_dynamic":
        names = {None: "auto", True: "true", False: "false"}
        original = flex_compiled.compiled_flex

        def compiled_flex(device_type, dynamic=None):
            calls.append(names[dynamic])
            return original(device_type, dynamic)

        monkeypatch.setattr(flex_compiled, "compiled_flex", compiled_flex)
    return calls


CASES = [(field, value) for field, (values, _, _) in CHOICES.items() for value in values]
CASES += [("flex_dynamic", "auto")]
BASE = dict(decode_eviction="torch", decode_attention="torch", mlstm_step="torch", chunk_attention="dense",
            flex_block_mask="interval", chunk_cutoff="blocked", flex_dynamic="auto")
FLEX_FIELDS = ("flex_block_mask", "chunk_cutoff", "flex_dynamic")


@pytest.mark.parametrize("field,value", CASES)
def test_each_choice_reaches_its_path_and_gives_the_reference(field, value, monkeypatch):
    chosen = dict(BASE, **({"chunk_attention": "flex"} if field in FLEX_FIELDS else {}), **{field: value})
    model = tiny_model("qwen3")
    ids = distinct_ids(2, 30, seed=4)
    kw = dict(sinks=2, window=4, topk=6, log_gamma=-0.3, decay_step=5)
    cache = KVpopCache(model.config, scorer="mlstm", backends=chosen, **kw)
    ref, _ = reference_logits(model, ids, cache.scorer, kw["sinks"], kw["window"], kw["topk"], cache.log_gamma,
                              kw["decay_step"])
    calls = _paths(monkeypatch, field, value)
    out = run_chunks(model, ids, cache, sizes=(9, 1, 1, 6, 1, 12))  # chunks and decode steps
    assert all(layer.backends == Backends(**chosen) for layer in cache.layers)
    assert calls and set(calls) == {value}, calls
    torch.testing.assert_close(out, ref, atol=3e-5, rtol=0)
