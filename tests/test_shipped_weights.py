"""kvpop_lab.shipped: the xz-packed checkpoint weights are restored byte for byte, once, atomically."""

import lzma
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpop_lab.shipped import unpack_all, unpack_weights

ROOT = Path(__file__).resolve().parents[1]


def pack(folder: Path, payload: bytes, name: str = "model.safetensors") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    packed = folder / (name + ".xz")
    packed.write_bytes(lzma.compress(payload))
    return packed


def test_unpacks_once_and_again_when_the_packed_file_is_newer(tmp_path):
    payload = os.urandom(3000) * 7
    packed = pack(tmp_path / "ckpt", payload)
    target = packed.with_suffix("")
    assert unpack_weights(packed.parent) == [target]
    assert target.read_bytes() == payload
    assert target.stat().st_mode & 0o444 == 0o444  # readable by all, as a checked-out file
    assert unpack_weights(packed.parent) == []  # up to date: nothing written
    packed.write_bytes(lzma.compress(b"new weights"))
    later = target.stat().st_mtime + 5
    os.utime(packed, (later, later))
    assert unpack_weights(packed.parent) == [target]
    assert target.read_bytes() == b"new weights"


def test_unpack_all_walks_the_checkpoint_folders(tmp_path):
    pack(tmp_path / "a", b"a" * 100)
    pack(tmp_path / "b", b"b" * 100, "adapter_model.safetensors")
    (tmp_path / "c").mkdir()
    written = unpack_all(tmp_path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in written) == [
        "a/model.safetensors", "b/adapter_model.safetensors"]
    assert unpack_all(tmp_path / "missing") == []


def test_a_corrupt_packed_file_raises_and_leaves_nothing(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "model.safetensors.xz").write_bytes(lzma.compress(b"x" * 1000)[:-20])
    with pytest.raises(ValueError, match="not a complete xz file.*git checkout"):
        unpack_weights(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["model.safetensors.xz"]


def test_the_teacher_is_tracked_packed_and_restored():
    teacher = ROOT / "checkpoints" / "testbed-4k-teacher"
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "ls-files", str(teacher)], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    assert "checkpoints/testbed-4k-teacher/model.safetensors.xz" in tracked
    assert "checkpoints/testbed-4k-teacher/model.safetensors" not in tracked
    # importing the laboratory (the conftest does) restored it; the safetensors header is readable
    from safetensors import safe_open

    with safe_open(teacher / "model.safetensors", "pt") as f:
        assert "lm_head.weight" in f.keys()


def test_the_command_line(tmp_path):
    pack(tmp_path / "ckpt", b"w" * 64)
    res = subprocess.run([sys.executable, "-m", "kvpop_lab.shipped", str(tmp_path / "ckpt")], capture_output=True,
                         text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert "unpacked" in res.stdout and (tmp_path / "ckpt" / "model.safetensors").read_bytes() == b"w" * 64
