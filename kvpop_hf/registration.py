"""Registering the ``"kvpop"`` attention name with transformers without paying for transformers' model stack at
``import kvpop_hf``.

transformers keeps attention implementations in ``AttentionInterface`` (``transformers.modeling_utils``) and mask
functions in ``AttentionMaskInterface`` (``transformers.masking_utils``); it offers no entry point through which an
installed package registers a name itself (a ``"namespace/name"`` implementation is a Hub kernel, downloaded by the
``kernels`` package). Importing ``transformers.modeling_utils`` takes seconds (it loads torch's compiler stack), so
``import kvpop_hf`` does not import it: where it is already imported the name is registered at once, else right
after transformers imports it (and ``masking_utils``) -- which every model class does before a model is built --
through a standard
``sys.meta_path`` finder (``importlib``'s hook for code that runs when a module is imported) that runs
:func:`kvpop_hf.attention.register` once and removes itself. ``kvpop_hf.register_attention()`` registers at once.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
import warnings

# the modules whose registries the name goes into: registered once the first has executed (the registration imports
# the other), or at the end of the other where that one is still executing
WATCHED = ("transformers.modeling_utils", "transformers.masking_utils")
_lock = threading.Lock()
ATTENTION = "kvpop_hf.attention"  # the module that holds the attention and mask functions


def _loaded(name: str) -> bool:
    module = sys.modules.get(name)
    return module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False)


def register_attention() -> None:
    """Register the ``"kvpop"`` attention and mask functions with transformers now (idempotent). Where
    ``kvpop_hf.attention`` is itself being imported (it imports transformers' registries, which calls this), it
    registers at its own end."""
    if ATTENTION in sys.modules and not _loaded(ATTENTION):
        return
    from .attention import register

    register()


def register_when_transformers_loads() -> None:
    """Register now if transformers' registries are imported, else once they are (see the module docstring)."""
    if all(_loaded(name) for name in WATCHED):
        register_attention()
        return
    with _lock:
        if not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _RegisterAfterImport())


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds the watched modules with the other finders and wraps their loaders so that the registration runs
    right after one of them has executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in WATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _RegisteringLoader(spec.loader, self)
        return spec


class _RegisteringLoader(importlib.abc.Loader):
    """The module's own loader, plus the registration after ``exec_module``; everything else is delegated."""

    def __init__(self, loader, finder: _RegisterAfterImport):
        self._loader, self._finder = loader, finder

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        if any(name in sys.modules and not _loaded(name) for name in WATCHED if name != module.__name__):
            return  # the other registry's module is still executing: it registers at its end
        with _lock:
            if self._finder not in sys.meta_path:
                return
            sys.meta_path.remove(self._finder)
        try:
            register_attention()
        except Exception as err:  # transformers itself must keep importing; the name is then simply missing
            warnings.warn(f"kvpop_hf could not register the 'kvpop' attention implementation: {err!r}. "
                          "Call kvpop_hf.register_attention() to see the full error.", stacklevel=2)

    def __getattr__(self, name):  # get_source, get_code, is_package, get_resource_reader, ...
        return getattr(self._loader, name)
