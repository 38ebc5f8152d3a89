"""The tracked tree stays small enough to clone quickly and to travel to a GPU machine (whose working-tree copy is
capped at 64 MiB): at most 24,000,000 bytes over ``git ls-files``. It holds the library, its tests and docs, one
page of results and the three testbed checkpoints (a bf16 teacher of 11.5 MB, tracked as the plain
``model.safetensors`` a Hub folder holds, and two LoRA students)."""

import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.tier("scripts")

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 24_000_000


def tracked_files() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / p for p in out.decode().split("\0") if p]


def test_tracked_bytes_under_limit():
    files = [p for p in tracked_files() if p.is_file() and not p.is_symlink()]
    sizes = {p.relative_to(ROOT).as_posix(): p.stat().st_size for p in files}
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
    assert total <= LIMIT, f"tracked files hold {total:,} bytes (> {LIMIT:,}); largest: {largest}"
