"""The repository's checkpoints keep their large weight files xz-compressed (``model.safetensors.xz``: the testbed
teacher is 11.5 MB as bf16 safetensors, 8.1 MB packed), so the tracked tree stays small; this restores the
``model.safetensors`` beside each packed file, once, before anything loads the folder.

Importing :mod:`kvpop_lab` does it for the repository's ``checkpoints/`` (every laboratory command, the test suite
and the GPU scripts import it). By hand: ``python -m kvpop_lab.shipped [FOLDER ...]``, or ``xz -dk FILE.xz``.
"""

from __future__ import annotations

import lzma
import os
import shutil
import sys
import tempfile
from pathlib import Path

CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"
SUFFIX = ".safetensors.xz"


def unpack_weights(folder: str | os.PathLike) -> list[Path]:
    """Decompress every ``*.safetensors.xz`` of ``folder`` whose ``*.safetensors`` is missing or older than it.

    Written to a temporary file in the same folder and renamed into place, so a process that loads the folder
    meanwhile sees the whole file or none. Returns the files written.
    """
    written = []
    for packed in sorted(Path(folder).glob("*" + SUFFIX)):
        target = packed.with_suffix("")
        if target.is_file() and target.stat().st_mtime >= packed.stat().st_mtime:
            continue
        fd, tmp = tempfile.mkstemp(dir=packed.parent, prefix=".unpacking-")
        try:
            with lzma.open(packed) as src, os.fdopen(fd, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            os.chmod(tmp, 0o666 & ~_umask())
            os.replace(tmp, target)
        except (lzma.LZMAError, EOFError) as err:
            Path(tmp).unlink(missing_ok=True)
            raise ValueError(f"{packed} is not a complete xz file ({err}); restore it from git "
                             f"(git checkout -- {packed}) or from the checkpoint's Hub repository") from err
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        written.append(target)
    return written


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def unpack_all(root: str | os.PathLike = CHECKPOINTS) -> list[Path]:
    """:func:`unpack_weights` on every folder directly under ``root`` (nothing when ``root`` does not exist)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return [f for sub in sorted(root.iterdir()) if sub.is_dir() for f in unpack_weights(sub)]


def main(argv: list[str] | None = None) -> int:
    folders = list(sys.argv[1:] if argv is None else argv)
    written = [f for d in folders for f in unpack_weights(d)] if folders else unpack_all()
    for f in written:
        print(f"unpacked {f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
