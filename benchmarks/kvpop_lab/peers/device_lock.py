"""Turns on one shared device between processes (pure Python, no kvpop_hf): the quality runs take it shared, one
generation at a time, and a speed measurement takes it alone for what it times, so its numbers see no other work
on the device while its compilation overlaps theirs. Two ``flock`` files in one folder:

* ``gate.lock``: a sharer passes it (shared, released at once) before each generation; the measurement holds it
  exclusively, so no new generation starts while it waits for the running ones;
* ``device.lock``: held shared for the length of a generation, exclusively by the measurement.

The kernel drops a dead process's locks, so a killed process never leaves the others waiting. ``DeviceLock(None)``
does nothing (a run with the device to itself).
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path

__all__ = ["DeviceLock"]


class DeviceLock:
    """``shared()`` around each generation of a sharer; ``acquire()`` / ``release()`` (or ``exclusive()``) around
    each timed part of a measurement. ``release`` without a held lock does nothing."""

    def __init__(self, folder: str | Path | None):
        self.folder = None if folder is None else Path(folder)
        self.held = False
        self._gate = self._device = None
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._gate = os.open(self.folder / "gate.lock", os.O_CREAT | os.O_RDWR, 0o644)
            self._device = os.open(self.folder / "device.lock", os.O_CREAT | os.O_RDWR, 0o644)

    @contextmanager
    def shared(self):
        """A sharer's turn: waits while a measurement holds the device, then holds it shared."""
        if self.folder is None:
            yield
            return
        fcntl.flock(self._gate, fcntl.LOCK_SH)
        fcntl.flock(self._gate, fcntl.LOCK_UN)
        fcntl.flock(self._device, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(self._device, fcntl.LOCK_UN)

    def acquire(self) -> None:
        """The device alone: closes the gate, then waits for the running generations to end."""
        if self.folder is None or self.held:
            return
        fcntl.flock(self._gate, fcntl.LOCK_EX)
        fcntl.flock(self._device, fcntl.LOCK_EX)
        self.held = True

    def release(self) -> None:
        if self.folder is None or not self.held:
            return
        fcntl.flock(self._device, fcntl.LOCK_UN)
        fcntl.flock(self._gate, fcntl.LOCK_UN)
        self.held = False

    @contextmanager
    def exclusive(self):
        self.acquire()
        try:
            yield
        finally:
            self.release()
