"""The scorer registry: name -> `Scorer` class, read by ``KVpopCache(scorer="name")``, ``build_scorer`` and the
``scorer`` field of a checkpoint's ``kvpop_config.json``.

The library registers its learned scorers here; :mod:`kvpop_hf.baselines` plugs in the baselines' (it is
imported by ``import kvpop_hf``), and a user registers a scorer of their own with :func:`register_scorer`. An entry
is a class or a ``"module:Class"`` path, imported on its first lookup, so registering imports nothing (``import
kvpop_hf`` stays light). A leaf module: it imports no other module of the library.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from importlib import import_module


class ScorerRegistry(MutableMapping):
    """A mapping ``name -> Scorer class`` whose entries may be given as ``"module:Class"`` paths."""

    def __init__(self):
        self._entries: dict[str, type | str] = {}

    def register(self, name: str, target: type | str, replace: bool = False) -> None:
        """Add ``name`` -> ``target`` (a `Scorer` subclass or its ``"module:Class"`` path). A name already taken by
        another target is refused unless ``replace``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"A scorer name must be a non-empty string, got {name!r}.")
        if isinstance(target, str):
            module, _, attr = target.partition(":")
            if not module or not attr or ":" in attr:
                raise ValueError(f"Scorer {name!r}: a path must read 'package.module:ClassName', got {target!r}.")
        elif not isinstance(target, type):
            raise ValueError(f"Scorer {name!r}: register a Scorer subclass or its 'module:Class' path, got "
                             f"{type(target).__name__}.")
        old = self._entries.get(name)
        if old is not None and not replace and _path(old) != _path(target):
            raise ValueError(f"The scorer name {name!r} is taken by {_path(old)}: pick another name, or pass "
                             "replace=True to override it.")
        self._entries[name] = target

    def __getitem__(self, name: str) -> type:
        target = self._entries[name]
        if isinstance(target, str):
            module, _, attr = target.partition(":")
            try:
                target = getattr(import_module(module), attr)
            except (ImportError, AttributeError) as err:
                raise ImportError(f"The scorer {name!r} is registered as {self._entries[name]!r}, which cannot be "
                                  f"imported: {err}") from err
            self._entries[name] = target
        return target

    def __setitem__(self, name: str, target: type | str) -> None:
        self.register(name, target, replace=True)

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"ScorerRegistry({sorted(self._entries)})"

    def name_of(self, cls: type) -> str | None:
        """The name ``cls`` is registered under (without importing the other entries), or None."""
        for name, target in self._entries.items():
            if target is cls or (isinstance(target, str) and target == _path(cls)):
                return name
        return None


def _path(target: type | str) -> str:
    return target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"


SCORERS = ScorerRegistry()


def register_scorer(name: str, target: type | str, replace: bool = False) -> None:
    """Register a scorer under ``name`` for ``KVpopCache(scorer=name)`` and ``build_scorer`` (see
    :meth:`ScorerRegistry.register`)."""
    SCORERS.register(name, target, replace=replace)


register_scorer("mlp", "kvpop_hf.scorers.mlp:MLPScorer")
register_scorer("mlstm", "kvpop_hf.scorers.mlstm:MLSTMScorer")
