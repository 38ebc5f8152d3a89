"""save_pretrained / from_pretrained / Hub repo ids through huggingface_hub (offline local cache)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import distinct_ids, tiny_config, tiny_model
from kvpop_hf import KVpopCache
from kvpop_hf.compat import with_cache
from kvpop_hf.hub import CONFIG_NAME, WEIGHTS_NAME

pytestmark = pytest.mark.tier("unit")


def _scores(cache, layer=1):
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 2, 9, 16, generator=g), torch.randn(2, 2, 9, 16, generator=g)
    pos = torch.arange(9).expand(2, 2, 9)
    sc = cache.scorer
    if sc.stateful:
        state = sc.init_state(layer, 2, k.device)
        return sc.absorb_and_read(layer, state, k, v, torch.ones(2, 9, dtype=torch.bool), k, v)[1]
    return sc.score(layer, k, v, pos)


@pytest.mark.parametrize("scorer", ["mlp", "mlstm", "knorm", "kvp"])
def test_save_load_local_dir_bit_identical(tmp_path, scorer):
    model = tiny_model("qwen3")
    cache = KVpopCache(model.config, sinks=3, window=5, topk=7, scorer=scorer, log_gamma=-0.1, decay_step=8)
    with torch.no_grad():
        for p in cache.scorer.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # "trained" weights
    cache.save_pretrained(tmp_path)
    assert json.loads((tmp_path / CONFIG_NAME).read_text())["topk"] == 7
    loaded = KVpopCache.from_pretrained(tmp_path, model.config)
    assert loaded.kvpop_config == cache.kvpop_config
    assert torch.equal(_scores(loaded), _scores(cache))
    assert torch.equal(loaded.log_gamma, cache.log_gamma)
    ids = distinct_ids(1, 30)
    a = model.generate(ids, **with_cache(model, cache), max_new_tokens=10, do_sample=False, pad_token_id=0)
    b = model.generate(ids, **with_cache(model, loaded), max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(a, b)


def _fake_hub_cache(root, repo_id, src):
    """Lay out `src` as a snapshot of `repo_id` in a huggingface_hub cache directory."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = root / ("models--" + repo_id.replace("/", "--"))
    snap = repo_dir / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in src.iterdir():
        shutil.copy(f, snap / f.name)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)


def test_load_repo_id_from_offline_hf_cache(tmp_path):
    model = tiny_model("qwen3")
    cache = KVpopCache(model.config, sinks=3, window=5, topk=7, scorer="mlstm")
    cache.save_pretrained(tmp_path / "ckpt")
    hub_cache = tmp_path / "hub"
    _fake_hub_cache(hub_cache, "kvpop-org/tiny-qwen3-kvpop", tmp_path / "ckpt")
    expect = _scores(cache)
    torch.save(expect, tmp_path / "expect.pt")
    # a fresh process, so HF_HUB_OFFLINE is read by huggingface_hub at import time
    code = (
        "import torch; from kvpop_hf import KVpopCache; "
        "from test_cache_hub import _scores; "
        "c = KVpopCache.from_pretrained('kvpop-org/tiny-qwen3-kvpop'); "
        f"assert torch.equal(_scores(c), torch.load(r'{tmp_path / 'expect.pt'}')); print('OK')"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub_cache), HF_HOME=str(tmp_path / "home"),
               PYTHONPATH=os.pathsep.join([root, os.path.join(root, "tests")]))
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-2000:]


def test_checkpoint_shape_mismatch_is_rejected(tmp_path):
    model = tiny_model("qwen3")
    KVpopCache(model.config, scorer="mlp").save_pretrained(tmp_path)
    other = tiny_model("qwen3", layers=3)
    with pytest.raises(ValueError, match="num_layers=2"):
        KVpopCache.from_pretrained(tmp_path, other.config)
    other = tiny_model("qwen3", num_key_value_heads=4)
    with pytest.raises(ValueError, match="num_kv_heads"):
        KVpopCache.from_pretrained(tmp_path, other.config)
    # without the model config the mismatch is caught at the first update, before attention runs
    loaded = KVpopCache.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="KV heads"):
        other(distinct_ids(1, 5), **with_cache(other, loaded))


def test_corrupt_or_missing_weights(tmp_path):
    model = tiny_model("qwen3")
    KVpopCache(model.config, scorer="mlp").save_pretrained(tmp_path)
    (tmp_path / WEIGHTS_NAME).write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="corrupt"):
        KVpopCache.from_pretrained(tmp_path)
    (tmp_path / WEIGHTS_NAME).unlink()
    with pytest.raises(FileNotFoundError, match=WEIGHTS_NAME):
        KVpopCache.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such directory"):
        KVpopCache.from_pretrained(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=CONFIG_NAME):
        KVpopCache.from_pretrained(tmp_path / "empty")
    (tmp_path / CONFIG_NAME).write_text("{broken")
    with pytest.raises(ValueError, match="not valid JSON"):
        KVpopCache.from_pretrained(tmp_path)


def test_weights_beside_a_weightless_scorer_are_refused(tmp_path):
    from kvpop_hf import KVpopCache

    cfg = tiny_config()
    KVpopCache(cfg, sinks=1, window=2, topk=3, scorer="mlp").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "kvpop_config.json").read_text())
    config["scorer"], config["scorer_kwargs"] = "knorm", {}
    (tmp_path / "kvpop_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="do not belong together"):
        KVpopCache.from_pretrained(tmp_path, cfg)


def test_uncached_repo_offline_says_so(tmp_path):
    from kvpop_hf import KVpopCache

    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache"):
        KVpopCache.from_pretrained("kvpop-test-org/not-downloaded", tiny_config(), local_files_only=True,
                                   cache_dir=str(tmp_path))


@pytest.fixture
def no_hub_calls(monkeypatch):
    """Offline, and any download through huggingface_hub fails the test."""
    import huggingface_hub

    import kvpop_hf.hub

    def called(*args, **kwargs):
        raise AssertionError(f"a Hub download was attempted: {args} {kwargs}")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("hf_hub_download", "snapshot_download"):
        monkeypatch.setattr(huggingface_hub, name, called)
    monkeypatch.setattr(kvpop_hf.hub, "hf_hub_download", called)


@pytest.mark.parametrize("name", ["checkpoints/kvpop_mlp", "./nope", "../nope-kvpop-missing", "a/b/c", "~/nope-kvpop",
                                  ".", "checkpoints/sub/kvpop", "kvpop_mlp", "kvpop mlp"])
def test_a_missing_local_path_fails_at_once(tmp_path, monkeypatch, no_hub_calls, name):
    (tmp_path / "work" / "checkpoints").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with pytest.raises(FileNotFoundError) as err:
        KVpopCache.from_pretrained(name, tiny_config())
    if name == ".":  # exists, but holds no checkpoint
        assert CONFIG_NAME in str(err.value)
    else:
        assert f"no such directory: {name}" in str(err.value)
    if name == "checkpoints/kvpop_mlp":
        assert "checkpoints/ is a local directory" in str(err.value)
    if name == "kvpop_mlp":
        assert "a Hub repo id names its namespace" in str(err.value)


def test_absolute_path_file_and_bad_repo_id_fail_at_once(tmp_path, monkeypatch, no_hub_calls):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such directory: "):
        KVpopCache.from_pretrained(str(tmp_path / "missing"))
    (tmp_path / "file.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="not a directory: file.json is a file"):
        KVpopCache.from_pretrained("file.json")
    with pytest.raises(ValueError, match="neither an existing directory nor a valid Hub repo id"):
        KVpopCache.from_pretrained("org/bad name")
    with pytest.raises(ValueError, match="Empty checkpoint name"):
        KVpopCache.from_pretrained("")
    with pytest.raises(TypeError, match="str or path"):
        KVpopCache.from_pretrained(3)


def test_relative_checkpoint_directory_loads_without_the_hub(tmp_path, monkeypatch, no_hub_calls):
    cfg = tiny_config()
    KVpopCache(cfg, sinks=1, window=2, topk=3, scorer="mlp").save_pretrained(tmp_path / "checkpoints" / "kvpop_mlp")
    monkeypatch.chdir(tmp_path)
    for name in ("checkpoints/kvpop_mlp", "./checkpoints/kvpop_mlp"):
        assert KVpopCache.from_pretrained(name, cfg).kvpop_config.topk == 3


def test_repo_id_goes_to_the_hub_and_a_failed_download_is_not_called_offline(tmp_path, monkeypatch):
    """A ``namespace/name`` with no such local folder is a repo id; when the Hub cannot be reached (downloads on),
    the error says so rather than that downloads are off."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    import kvpop_hf.hub

    seen = []

    def unreachable(repo_id, filename, **kwargs):
        seen.append(repo_id)
        raise LocalEntryNotFoundError("Cannot reach the Hub (connection error)")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(kvpop_hf.hub, "hf_hub_download", unreachable)
    monkeypatch.setattr(kvpop_hf.hub.constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(FileNotFoundError) as err:
        KVpopCache.from_pretrained("kvpop-test-org/somewhere", tiny_config(), cache_dir=str(tmp_path / "hub"))
    assert seen == ["kvpop-test-org/somewhere"]
    assert "could not be downloaded" in str(err.value) and "downloads are off" not in str(err.value)


def test_a_failed_download_names_a_close_local_folder(tmp_path, monkeypatch):
    """``chekpoints/kvpop_mlp`` is a valid repo id; where the Hub cannot be reached, the error points at the local
    ``checkpoints/`` folder the user probably meant."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    import kvpop_hf.hub

    def unreachable(repo_id, filename, **kwargs):
        raise LocalEntryNotFoundError("Cannot reach the Hub (connection error)")

    (tmp_path / "checkpoints").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(kvpop_hf.hub, "hf_hub_download", unreachable)
    monkeypatch.setattr(kvpop_hf.hub.constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(FileNotFoundError, match="Did you mean the local path checkpoints/kvpop_mlp"):
        KVpopCache.from_pretrained("chekpoints/kvpop_mlp", tiny_config(), cache_dir=str(tmp_path / "hub"))
