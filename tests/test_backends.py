"""One record of backends for inference and training (kvpop_hf/backends.py): defaults per device, the environment
for defaults only, clear errors, the docs' table equal to the record, and end to end: each choice of each backend
reaches the code path it names and gives the reference (Triton kernels through the interpreter, float32, on CPU)."""

import re
import warnings
from pathlib import Path

import pytest
import torch

from helpers import distinct_ids, reference_logits, run_chunks, tiny_model
from kvpop_hf import Backends, KVpopCache
from kvpop_hf.backends import CHOICES, INFERENCE_FIELDS, TRAINING_FIELDS, VARIANTS, env_var

pytestmark = pytest.mark.tier("unit")

warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def no_backend_environment(monkeypatch):
    for name in CHOICES:
        monkeypatch.delenv(env_var(name), raising=False)


def test_auto_defaults_per_device():
    assert Backends.defaults(CUDA) == Backends(decode_eviction="triton", decode_attention="triton", mlstm_step="triton",
                                               chunk_attention="flex", running_topk="wavelet", train_attention="flex",
                                               target_pass="flex", _flex_block_mask="interval", _chunk_cutoff="blocked",
                                               _train_block_mask="interval")
    assert Backends().resolve(CPU) == Backends(decode_eviction="torch", decode_attention="torch", mlstm_step="torch",
                                               chunk_attention="dense", running_topk="torch", train_attention="dense",
                                               target_pass="chunked", _flex_block_mask="interval",
                                               _chunk_cutoff="blocked", _train_block_mask="interval")


def test_resolving_some_fields_leaves_the_others_as_given():
    record = Backends(decode_eviction="torch", running_topk="triton")
    inference = record.resolve(CPU, INFERENCE_FIELDS)  # what a cache layer does: no triton asked for
    assert inference.running_topk == "triton" and inference.train_attention is None
    assert inference.chunk_attention == "dense" and inference._flex_block_mask == "interval"
    training = Backends(decode_attention="triton").resolve(CPU, TRAINING_FIELDS)
    assert training.decode_attention == "triton" and training.target_pass == "chunked"
    assert set(INFERENCE_FIELDS) | set(TRAINING_FIELDS) == set(CHOICES) | set(VARIANTS)
    with pytest.raises(ValueError, match=r"Unknown backends \['decode'\]"):
        record.resolve(CPU, ("decode",))


def test_environment_gives_defaults_and_an_explicit_choice_wins(monkeypatch):
    monkeypatch.setenv("KVPOP_DECODE_EVICTION", "Triton")
    monkeypatch.setenv("KVPOP_CHUNK_ATTENTION", "flex")
    monkeypatch.setenv("KVPOP_TARGET_PASS", "flex")
    resolved = Backends(chunk_attention="dense").resolve(CPU)
    assert (resolved.decode_eviction, resolved.chunk_attention, resolved.target_pass) == ("triton", "dense", "flex")
    assert Backends.coerce({"decode_eviction": "torch"}).resolve(CPU).decode_eviction == "torch"
    assert Backends(running_topk="wavelet").given() == {"running_topk": "wavelet"}


def test_a_target_reduction_other_than_the_mean_takes_the_chunked_pass(monkeypatch):
    assert Backends().resolve(CUDA, ("target_pass",), target_reduce="max").target_pass == "chunked"
    assert Backends().resolve(CUDA, ("target_pass",), target_reduce="mean").target_pass == "flex"
    with pytest.raises(ValueError, match="target_reduce='p4' runs on the chunked target pass"):
        Backends(target_pass="flex").resolve(CPU, ("target_pass",), target_reduce="p4")
    monkeypatch.setenv("KVPOP_TARGET_PASS", "flex")
    with pytest.raises(ValueError, match="chunked target pass"):
        Backends().check_target_reduce("max")
    Backends(target_pass="chunked").check_target_reduce("max")  # explicit wins


def test_bad_choices_are_refused_naming_the_allowed_values(monkeypatch):
    with pytest.raises(ValueError, match=r"Backends\(decode_eviction=...\) must be one of \('auto', 'torch', 'triton'\)"):
        Backends(decode_eviction="cuda")
    with pytest.raises(ValueError, match=r"Backends\(_flex_block_mask=...\) must be one of \('interval', 'tiled', "):
        Backends(_flex_block_mask="auto")  # a variant has one default, no "auto"
    with pytest.raises(ValueError, match="Unknown backends \\['chunk'\\]"):
        Backends.coerce({"chunk": "flex"})
    with pytest.raises(ValueError, match="must be a kvpop_hf.Backends, a dict"):
        Backends.coerce("torch")
    model = tiny_model("qwen3")
    monkeypatch.setenv("KVPOP_CHUNK_ATTENTION", "sparse")
    with pytest.raises(ValueError, match=r"KVPOP_CHUNK_ATTENTION must be one of \('auto', 'dense', 'flex'\)"):
        KVpopCache(model.config, sinks=2, window=4, topk=6)  # refused at construction, before any forward
    KVpopCache(model.config, sinks=2, window=4, topk=6, backends={"chunk_attention": "dense"})  # explicit wins


def test_triton_off_cuda_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        Backends(decode_attention="triton").resolve(CPU)
    assert Backends(decode_attention="triton").resolve(CUDA).decode_attention == "triton"


def test_triton_missing_is_an_import_error_naming_the_fix(monkeypatch):
    import kvpop_hf.backends as backends

    monkeypatch.setattr(backends, "triton_available", lambda: False)
    assert Backends().resolve(CPU).decode_attention == "torch"  # auto off CUDA needs no triton
    assert Backends().resolve(CUDA, TRAINING_FIELDS).running_topk == "wavelet"  # nor does training's auto on CUDA
    with pytest.raises(ImportError, match=r'pip install -e "\.\[gpu\]".*KVPOP_DECODE_ATTENTION=torch'):
        Backends(decode_attention="triton").resolve(CPU)
    with pytest.raises(ImportError, match=r"-e \"\.\[gpu\]\".*KVPOP_RUNNING_TOPK=torch"):
        Backends(running_topk="triton").resolve(CPU)
    with pytest.raises(ImportError, match=r"-e \"\.\[gpu\]\".*Backends\(_chunk_cutoff='blocked'\)"):
        Backends(_chunk_cutoff="triton").resolve(CPU)
    with pytest.raises(ImportError, match=r"-e \"\.\[gpu\]\""):
        Backends().resolve(CUDA)  # auto on CUDA is the Triton kernels


def test_the_kernels_own_choices_go_through_the_resolver(monkeypatch):
    """running_topk and chunk_cutoff, called directly, check their choice as the record does."""
    from kvpop_hf.ops.flex_mask import chunk_cutoff
    from kvpop_hf.ops.running_topk import running_topk

    prio = torch.randn(1, 2, 12)
    with pytest.raises(ValueError, match=r"Backends\(running_topk=...\) must be one of"):
        running_topk(prio, 1, 2, 3, backend="fenwick")
    pos = torch.arange(8).expand(1, 1, 8).contiguous()
    args = (pos, pos.flip(-1).contiguous(), torch.arange(8, 10)[None], 1, 2, 3)
    with pytest.raises(ValueError, match=r"Backends\(_chunk_cutoff=...\) must be one of"):
        chunk_cutoff(*args, backend="auto")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for call in (lambda: running_topk(prio, 1, 2, 3, backend="triton"), lambda: chunk_cutoff(*args, backend="triton")):
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            call()


def test_not_saved_with_the_config(tmp_path):
    model = tiny_model("qwen3")
    cache = KVpopCache(model.config, sinks=2, window=4, topk=6, backends={"decode_eviction": "torch"})
    cache.save_pretrained(tmp_path)
    assert "backend" not in (tmp_path / "kvpop_config.json").read_text()
    loaded = KVpopCache.from_pretrained(tmp_path, model.config, backends=Backends(chunk_attention="flex"))
    assert loaded.backends == Backends(chunk_attention="flex")


def test_the_docs_table_is_the_record():
    """docs/backends.md has one table, one row per public field: its choices, auto on CUDA and elsewhere, a test
    file that exists, the environment variable; no private variant is named there."""
    text = (ROOT / "docs" / "backends.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    table = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        table[cells[0].strip("`")] = cells
    assert list(table) == list(CHOICES)
    for name, (values, cuda, other) in CHOICES.items():
        cells = table[name]
        assert re.findall(r"`(\w+)`", cells[2]) == list(values), name
        assert cells[3] == f"`{cuda}`" and cells[4] == f"`{other}`", name
        assert cells[-1] == f"`{env_var(name)}`", name
        tests = re.findall(r"tests/[\w/]+\.py", cells[5])
        assert tests and all((ROOT / t).is_file() for t in tests), name
    assert not any(name in text for name in VARIANTS)


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
    """Spies on the inference functions that ``field=value`` names; returns the list they append to."""
    import kvpop_hf.ops.chunk_attention as chunk_attention
    import kvpop_hf.ops.decode_attention as decode_attention
    import kvpop_hf.ops.decode_eviction as decode_eviction
    import kvpop_hf.ops.flex_mask as flex_mask
    import kvpop_hf.ops.interval_mask as interval_mask
    import kvpop_hf.scorers.mlstm as mlstm
    import kvpop_hf.scorers.mlstm_decode_triton as mlstm_decode_triton
    import kvpop_hf.ops.running_topk as topk
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
    elif field == "_flex_block_mask":
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
    elif field == "_chunk_cutoff":
        _spy(monkeypatch, flex_mask, "blocked_chunk_cutoff", calls, "blocked")
        for v in ("torch", "wavelet", "triton"):
            _spy(monkeypatch, topk, {"torch": "running_topk_reference"}.get(v, f"running_topk_{v}"), calls, v)
    return calls


def _values(field):
    return CHOICES[field][0] if field in CHOICES else VARIANTS[field][0]


CASES = [(field, value) for field in INFERENCE_FIELDS for value in _values(field)]
BASE = dict(decode_eviction="torch", decode_attention="torch", mlstm_step="torch", chunk_attention="dense",
            _flex_block_mask="interval", _chunk_cutoff="blocked")
FLEX_FIELDS = ("_flex_block_mask", "_chunk_cutoff")


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


# ---------------------------------------------------------------- training: each choice reaches its path
def _training_paths(monkeypatch, field):
    import kvpop_hf.ops.running_topk as topk
    import kvpop_hf.trainer.sparse_attention as sparse_attention
    import kvpop_hf.trainer.student as student
    import kvpop_hf.ops.targets as targets

    calls = []
    if field == "running_topk":
        for v in ("torch", "wavelet", "triton"):
            _spy(monkeypatch, topk, {"torch": "running_topk_reference"}.get(v, f"running_topk_{v}"), calls, v)
    elif field == "train_attention":
        _spy(monkeypatch, student, "sparse_attention_reference", calls, "dense")
        _spy(monkeypatch, student, "sparse_attention", calls, "flex")
    elif field == "target_pass":
        _spy(monkeypatch, targets, "_chunked_log_sum", calls, "chunked")
        _spy(monkeypatch, targets, "_flex_log_sum", calls, "flex")
    elif field == "_train_block_mask":
        _spy(monkeypatch, sparse_attention, "interval_sparse_layout", calls, "interval")
        _spy(monkeypatch, sparse_attention, "sparse_block_mask", calls, "analytic")
    return calls


TRAINING_CASES = [(field, value) for field in TRAINING_FIELDS for value in _values(field)]
TRAINING_BASE = dict(running_topk="torch", train_attention="dense", target_pass="chunked", _train_block_mask="interval")


@pytest.mark.parametrize("field,value", TRAINING_CASES)
def test_each_training_choice_reaches_its_path_and_gives_the_reference(field, value, monkeypatch):
    """student_forward with one choice changed from the torch references gives their logits, boundary losses and
    recall (a flex block-mask variant runs with train_attention="flex")."""
    from kvpop_hf.trainer import StudentSettings, student_forward

    model = tiny_model("qwen3")
    model.set_attn_implementation("kvpop_train")
    ids = distinct_ids(2, 40, seed=5)
    cache = KVpopCache(model.config, scorer="mlstm", sinks=2, window=5, topk=6, log_gamma=-0.3, decay_step=4)

    def run(backends):
        st = StudentSettings(sinks=2, window=5, topk=6, decay_step=4, backends=backends)
        with torch.no_grad():
            out, rec = student_forward(model, cache.scorer, st, cache.log_gamma, input_ids=ids)
        return out.logits, torch.stack([rec.boundary[i] for i in sorted(rec.boundary)]), rec

    ref_logits, ref_boundary, _ = run(TRAINING_BASE)
    chosen = dict(TRAINING_BASE, **({"train_attention": "flex"} if field == "_train_block_mask" else {}),
                  **{field: value})
    calls = _training_paths(monkeypatch, field)
    logits, boundary, rec = run(chosen)
    assert calls and set(calls) == {value}, calls
    torch.testing.assert_close(logits, ref_logits, atol=3e-5, rtol=0)
    torch.testing.assert_close(boundary, ref_boundary, atol=1e-5, rtol=1e-5)
