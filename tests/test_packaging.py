"""The wheel carries what an installed kvpop-hf needs at run time (the model card template); the GPU
run scripts parse; triton is optional."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.tier("scripts")

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_ships_the_model_card_template(tmp_path):
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                          "-q", "-w", str(tmp_path)], capture_output=True, text=True)
    if res.returncode != 0 and "No module named" in res.stderr:
        pytest.skip(f"cannot build a wheel here: {res.stderr.strip()[-200:]}")
    assert res.returncode == 0, res.stderr
    wheel = next(tmp_path.glob("kvpop_hf-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "kvpop_hf/trainer/model_card_template.md" in names
    assert "kvpop_hf/ops/decode_eviction.py" in names and "kvpop_hf/cli/retrofit.py" in names
    assert not [n for n in names if n.startswith(("kvpop_lab/", "benchmarks/", "tests/"))]  # the laboratory stays out


def test_core_does_not_import_the_laboratory_or_the_trainer():
    """``import kvpop_hf`` and using a KVpopCache load the library core only (no laboratory, no trainer)."""
    code = ("import sys, kvpop_hf, kvpop_hf.cache, kvpop_hf.layer, kvpop_hf.attention, kvpop_hf.ops.flex_mask; "
            "print(sorted(m for m in sys.modules if m.startswith(('kvpop_lab', 'kvpop_hf.trainer'))))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", res.stdout


def test_gpu_scripts_parse():
    """The GPU run scripts (benchmarks/gpu/*.sh) are only run on a GPU machine: at least their syntax is checked
    here, so a typo does not cost a device call."""
    scripts = sorted((ROOT / "benchmarks").rglob("*.sh"))
    assert len(scripts) >= 10
    for script in scripts:
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, f"{script.name}: {result.stderr}"


def _data_mix(tmp_path, arms: str) -> subprocess.CompletedProcess:
    """retrofit_data_mix.sh with ``ARMS=arms`` and the test's python first on PATH (the script checks arm knobs with
    it); OUT is ``tmp_path / "out"``, which a refused run must not create."""
    env = dict(os.environ, OUT=str(tmp_path / "out"), ARMS=arms, TEACHER=str(tmp_path / "teacher"),
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    return subprocess.run(["bash", str(ROOT / "benchmarks/gpu/retrofit_data_mix.sh")], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=120)


@pytest.mark.parametrize("arms", ["a:reasoning:foo", "a:reasoning", ":reasoning:tok"])
def test_retrofit_data_mix_rejects_a_bad_arm_before_any_work(tmp_path, arms):
    res = _data_mix(tmp_path, arms)
    assert res.returncode == 2
    assert f"ARMS entry '{arms}'" in res.stderr and "tok or plain" in res.stderr
    assert not (tmp_path / "out").exists()  # nothing was started


@pytest.mark.parametrize("knobs", ["reasoning.distractor_density", "nofamily.x=1", "reasoning.n_facts=20+junk"])
def test_retrofit_data_mix_rejects_bad_arm_knobs_before_any_work(tmp_path, knobs):
    res = _data_mix(tmp_path, f"ok:reasoning:tok bad:reasoning:tok:{knobs}")
    assert res.returncode == 2
    assert f"ARMS entry 'bad:reasoning:tok:{knobs}'" in res.stderr and "FAMILY.KEY=VALUE" in res.stderr
    assert not (tmp_path / "out").exists()


def test_retrofit_data_mix_accepts_good_arm_knobs(tmp_path):
    """Valid knobs pass the check: the run stops at the next arm's bad scorer, not at the knobs."""
    res = _data_mix(tmp_path, "a:reasoning:tok:reasoning.distractor_density=0+reasoning.n_facts=20 b:reasoning:foo")
    assert res.returncode == 2
    assert "ARMS entry 'b:reasoning:foo'" in res.stderr and "ARMS entry 'a:" not in res.stderr


def test_retrofit_data_mix_needs_a_teacher(tmp_path):
    """The 1024-token teacher is not shipped: TEACHER must name one, checked before any work."""
    res = _data_mix(tmp_path, "a:reasoning:tok")
    assert res.returncode == 2 and "holds no model" in res.stderr
    assert not (tmp_path / "out").exists()


_NO_TRITON = """
import os, sys
sys.modules["triton"] = None  # as if triton were not installed
"""


def _run(code: str) -> subprocess.CompletedProcess:
    """``python -c code`` in the repository root with the test helpers importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOP_") and k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests"), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)


def test_cpu_paths_work_without_triton():
    """triton is optional (the ``gpu`` extra): with it unimportable, ``import kvpop_hf``, CPU generation through a
    KVpopCache (the ``auto`` backends) and the kernels' torch references work, and asking for a Triton kernel is an
    ImportError that names the fix."""
    code = _NO_TRITON + """
import torch
import kvpop_hf
from helpers import tiny_model
from kvpop_hf import Backends, KVpopCache
from kvpop_hf.backends import INFERENCE_FIELDS
from kvpop_hf.compat import with_cache
from kvpop_hf.ops.decode_attention import decode_attention_for, split_decode_kernel
from kvpop_hf.ops.mlstm_decode import mlstm_decode_priority_reference  # noqa: F401
from kvpop_hf.ops.running_topk import running_topk

model = tiny_model("qwen3")
cache = KVpopCache(model.config, sinks=2, window=4, topk=6, scorer="mlstm")
with torch.no_grad():
    model(torch.arange(1, 10)[None], **with_cache(model, cache))
    for i in range(12):
        model(torch.tensor([[5 + i]]), **with_cache(model, cache))
assert cache.get_seq_length() == 21
assert cache.layers[0].backends == Backends.defaults("cpu", INFERENCE_FIELDS)
running_topk(torch.randn(2, 16), 1, 2, 3)
assert not [m for m in sys.modules if m.startswith("kvpop_hf") and m.endswith("fenwick_triton")]
errors = []
calls = [lambda: running_topk(torch.randn(2, 16), 1, 2, 3, backend="triton"), split_decode_kernel,
         lambda: decode_attention_for("triton"), lambda: Backends(mlstm_step="triton").resolve("cpu"),
         lambda: Backends().resolve("cuda"), lambda: Backends(_chunk_cutoff="triton").resolve("cpu")]
for call in calls:
    try:
        call()
    except ImportError as e:
        errors.append(str(e))
os.environ["KVPOP_DECODE_EVICTION"] = "triton"
try:
    with torch.no_grad():
        model(torch.tensor([[5]]), **with_cache(model, KVpopCache(model.config, sinks=2, window=4, topk=6)))
except ImportError as e:
    errors.append(str(e))
print(len(errors), all('pip install -e ".[gpu]"' in e for e in errors))
"""
    res = _run(code)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split()[-2:] == ["7", "True"], res.stdout


def test_import_does_not_import_triton():
    """``import kvpop_hf`` imports no triton of its own: no kvpop_hf module runs ``import triton`` and none binds
    a Triton kernel until one is first used (torch's dynamo, which transformers imports, may import an installed
    triton itself)."""
    code = """
import builtins, sys
importers = []
_import = builtins.__import__

def spy(name, globals=None, *args, **kwargs):
    if name.split(".")[0] == "triton" and (globals or {}).get("__name__", "").startswith("kvpop_hf"):
        importers.append(globals["__name__"])
    return _import(name, globals, *args, **kwargs)

builtins.__import__ = spy
import kvpop_hf, kvpop_hf.ops.decode_attention as a, kvpop_hf.ops.decode_eviction as e, kvpop_hf.ops.running_topk
import kvpop_hf.ops.mlstm_decode as m
kernels = {a: "split_decode_kernel", e: "evict_insert_kernel", m: "mlstm_decode_kernel"}
bound = [x.__name__ for x, k in kernels.items() if getattr(x, k).defined() or "tl" in vars(x)]
print(sorted(set(importers)), bound, [n for n in sys.modules if n.endswith("fenwick_triton")])
"""
    res = _run(code)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "[] [] []", res.stdout


HEAVY = ("triton", "matplotlib", "peft", "torch._dynamo", "torch._inductor", "transformers.modeling_utils",
         "kvpop_hf.trainer", "kvpop_lab.testbed", "kvpop_hf.baselines.dms")


def test_import_kvpop_hf_is_light():
    """``import kvpop_hf`` imports none of the heavy optional parts (triton, matplotlib, peft, torch's compiler,
    transformers' model stack, the trainer, the testbed): its public names load on first use."""
    code = f"import sys, kvpop_hf; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    res = _run(code)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "[]", res.stdout
    res = _run("import sys; from kvpop_hf import KVpopCache, KVpopConfig, build_scorer; "
               "print(sorted(m for m in sys.modules if m.startswith(('matplotlib', 'peft', 'kvpop_hf.trainer', "
               "'kvpop_lab.testbed'))))")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "[]", res.stdout


@pytest.mark.parametrize("order", ["kvpop_hf first", "transformers first", "masking_utils first",
                                   "modeling_utils only"])
def test_the_kvpop_attention_is_registered_whichever_imports_first(order):
    """The name is registered once transformers' model code is imported, before or after ``import kvpop_hf``; a
    model built with ``attn_implementation="kvpop"`` then runs the kvpop attention."""
    first = {"kvpop_hf first": "import kvpop_hf",
             "transformers first": "import transformers.modeling_utils, transformers.masking_utils; import kvpop_hf",
             "masking_utils first": "import transformers.masking_utils; import kvpop_hf",
             "modeling_utils only": "import kvpop_hf; import transformers.modeling_utils"}[order]
    code = first + """
from transformers import AttentionInterface, AttentionMaskInterface
assert "kvpop" in AttentionInterface._global_mapping and "kvpop" in AttentionMaskInterface._global_mapping
from helpers import tiny_model
import torch
from kvpop_hf import KVpopCache
from kvpop_hf.compat import with_cache
model = tiny_model("qwen3", attn="kvpop")
cache = KVpopCache(model.config, sinks=1, window=2, topk=2)
out = model.generate(torch.arange(1, 9)[None], **with_cache(model, cache, max_new_tokens=3, do_sample=False))
print(model.config._attn_implementation, out.shape[1], cache.get_seq_length())
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT / "tests",
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")])))
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split()[-3:] == ["kvpop", "11", "10"], res.stdout


@pytest.mark.parametrize("first, module", [("", "attention"), ("import torch", "attention"),
                                           ("import transformers", "attention"), ("", "cache"), ("", "trainer")])
def test_importing_a_submodule_first_registers_the_kvpop_attention_without_warnings(first, module):
    """``import kvpop_hf.<module>`` as the library's first import (alone, or after torch / transformers) registers
    ``"kvpop"`` with both of transformers' registries, without a warning (``-W error``)."""
    code = f"""{first}
import kvpop_hf.{module}
from transformers import AttentionInterface, AttentionMaskInterface
assert "kvpop" in AttentionInterface._global_mapping and "kvpop" in AttentionMaskInterface._global_mapping
print("registered")
"""
    res = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["registered"] and not res.stderr, res.stderr[-3000:]


def test_console_commands_resolve_and_the_training_scripts_run_them():
    """Every ``[project.scripts]`` entry names a callable; each training command's ``training/<name>.py`` runs that
    same ``main``; ``import kvpop_hf`` imports none of the commands."""
    import importlib
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for command, target in scripts.items():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), command
    for name in ("retrofit", "train_dms"):
        assert scripts["kvpop-" + name.replace("_", "-")] == f"kvpop_hf.cli.{name}:main"
        assert f"from kvpop_hf.cli.{name} import main" in (ROOT / "training" / f"{name}.py").read_text()
    lab = tomllib.loads((ROOT / "benchmarks" / "pyproject.toml").read_text())["project"]
    for name in ("train_kvp", "pretrain_teacher"):  # the laboratory's commands
        assert lab["scripts"]["kvpop-" + name.replace("_", "-")] == f"kvpop_lab.{name}:main"
        assert f"from kvpop_lab.{name} import main" in (ROOT / "training" / f"{name}.py").read_text()
    for command, target in list(lab["scripts"].items()) + list(lab["entry-points"]["kvpop_hf.generated_data"].items()):
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), command
    res = _run("import sys, kvpop_hf; print(sorted(m for m in sys.modules if m.startswith('kvpop_hf.cli')))")
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stderr


def test_no_script_edits_the_import_path():
    """Tests, training scripts and benchmarks import the packages as installed, never by editing the import path."""
    needle = "sys." + "path"
    found = sorted(str(p.relative_to(ROOT)) for folder in ("tests", "training", "benchmarks", "examples", "kvpop_hf")
                   for p in (ROOT / folder).rglob("*.py") if needle in p.read_text())
    assert found == [], found


def test_no_script_is_imported_as_a_library():
    """What a benchmark script and a test share lives in the laboratory package (kvpop_lab); no module imports a
    script of benchmarks/, training/ or examples/ by name."""
    import ast

    scripts = {p.stem for folder in ("benchmarks", "training", "examples") for p in (ROOT / folder).glob("*.py")}
    found = []
    for folder in ("tests", "benchmarks", "training", "examples", "kvpop_hf"):
        for p in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(p.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
                found += [f"{p.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in scripts]
    assert found == [], found


def test_ci_runs_both_quick_start_commands_as_the_readme_writes_them():
    """CI (`.ci/run`) runs README command 2 verbatim, and command 1 (through `.ci/quickstart.sh`, which reads it
    from the README) in a fresh venv of its own, so a dependency missing from the library's own install shows."""
    readme = (ROOT / "README.md").read_text()
    lines = readme.splitlines()
    cmd1 = lines[next(i for i, l in enumerate(lines) if l.startswith("# 1. ")) + 1]
    cmd2 = lines[next(i for i, l in enumerate(lines) if l.startswith("# 2. ")) + 1]
    assert cmd1.startswith("pip install") and "examples/generate.py" in cmd1 and "[test]" not in cmd1
    ci = (ROOT / ".ci" / "run").read_text()
    assert cmd2 in ci.splitlines()
    assert "bash .ci/quickstart.sh" in ci
    quick = (ROOT / ".ci" / "quickstart.sh").read_text()
    assert "grep -A1 '^# 1\\. ' README.md" in quick and "python3 -m venv .venv-quickstart" in quick


def test_pytest_configuration_imports_no_library_module():
    """pytest reads ``filterwarnings`` before conftest runs: a warning category of kvpop_hf there imports the
    library (and triton) before conftest sets TRITON_INTERPRET, and the Triton kernels then fail on CPU."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert not [f for f in config.get("filterwarnings", []) if "kvpop" in f.split(":")[2 if f.count(":") >= 2 else 0]]
