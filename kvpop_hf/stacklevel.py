"""Where a warning raised inside a model's forward should point: the user's code. A leaf module (it imports no
other module of the library), so any module can use it."""

from __future__ import annotations

import os
import sys

import torch


def user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first caller outside kvpop_hf, transformers, torch and
    the ``kernels`` package through which transformers >= 5.25 calls its layers (a warning raised inside a
    model's forward would otherwise point into library code)."""
    import transformers

    modules = (torch, transformers, sys.modules[__package__], sys.modules.get("kernels"))
    internal = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                     for m in modules if getattr(m, "__file__", None))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(internal):
        frame, level = frame.f_back, level + 1
    return level
