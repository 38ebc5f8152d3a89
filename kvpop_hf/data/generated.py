"""Generated training rows: ``--dataset NAME:SPEC`` of the training commands, for a generator that a package
installs under the entry-point group ``kvpop_hf.generated_data``.

The laboratory package (``pip install -e ./benchmarks``, distribution ``kvpop-lab``) installs ``testbed``:
``--dataset testbed:reasoning,vt`` builds seeded problems of those families. A generator is a callable
``rows(spec, tokenizer, seq_len, n, seed, knobs) -> list[dict]`` returning ``n`` rows of ``input_ids`` and
``labels`` (1-D ``LongTensor``s of ``seq_len`` tokens); ``knobs`` are the ``--knob FAMILY.KEY=VALUE`` strings.
A generator may carry ``rows.check(spec, knobs)``, which the commands call before loading anything (a bad spec
or knob is a ValueError there). The library itself imports no generator by name.
"""

from __future__ import annotations

import re
from importlib.metadata import entry_points
from pathlib import Path

__all__ = ["GROUP", "check_generated", "generated_rows", "generator_for"]

GROUP = "kvpop_hf.generated_data"
_NAME = re.compile(r"^(?P<name>[A-Za-z_][\w-]+):(?P<spec>.*)$")  # 2+ characters: "c:\\data" is a path
_HINTS = {"testbed": " The testbed comes with the laboratory package: `pip install -e ./benchmarks` in a clone of "
                     "the kvpop-hf repository."}


def _installed() -> dict:
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def generator_for(dataset: str):
    """``(generator, spec)`` when ``dataset`` is ``NAME:SPEC`` for an installed generator ``NAME``; ``None`` when it
    is a ``datasets`` source (no ``NAME:`` prefix, or an existing local path). A ``NAME:`` prefix that no installed
    package provides is a ValueError naming the installed ones."""
    m = _NAME.match(dataset)
    if m is None or Path(dataset).exists():
        return None
    installed = _installed()
    name = m.group("name")
    if name not in installed:
        known = ", ".join(sorted(installed)) or "none"
        raise ValueError(f"--dataset {dataset!r} asks for the generated source {name!r}, which no installed package "
                         f"provides (installed: {known}).{_HINTS.get(name, '')} A datasets source is a Hub name, a "
                         "local folder or data files, without a NAME: prefix.")
    return installed[name].load(), m.group("spec")


def generated_rows(dataset: str, tokenizer, seq_len: int, n: int, seed: int, knobs=()) -> list[dict]:
    """``n`` rows of ``seq_len`` tokens from the generator that ``dataset`` (``NAME:SPEC``) names."""
    found = generator_for(dataset)
    if found is None:
        raise ValueError(f"--dataset {dataset!r} is not NAME:SPEC of a generated source.")
    generator, spec = found
    return generator(spec, tokenizer, seq_len, n, seed, list(knobs))


def check_generated(dataset: str, knobs=()) -> None:
    """Check ``NAME:SPEC`` and its knobs before any loading (the generator's ``check``, where it has one)."""
    found = generator_for(dataset)
    if found is None:
        raise ValueError(f"--dataset {dataset!r} is not NAME:SPEC of a generated source.")
    generator, spec = found
    check = getattr(generator, "check", None)
    if check is not None:
        check(spec, list(knobs))
