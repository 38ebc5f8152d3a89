"""Every laboratory command that the results page cites still starts: its ``--help`` exits 0.

The commands are read from the provenance lines of ``results/RESULTS.md`` (``N. `command` (commit ..., date)``):
``python -m <module>`` (under any interpreter: ``<kvpress venv>/bin/python -m ...`` too), ``python <script>.py``
under benchmarks/, training/ or examples/, and the console commands the two pyproject files declare
(``kvpop-eval`` and the like). One subprocess asks each of them for ``--help``
(a module or script run as ``__main__`` with ``sys.argv = [name, "--help"]``, a console command through its entry
point) and reports the exit status of each; the figures themselves come from the listed commits, this only says
that the command still exists and parses its arguments at HEAD.
"""

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.tier("scripts")

REPO = Path(__file__).resolve().parent.parent
PROVENANCE = re.compile(r"^\d+\. `+ ?(.+?) ?`+ \(commit [^)]*", re.M)
MODULE = re.compile(r"(?<![\w.-])python3? -m ((?:kvpop_hf|kvpop_lab)(?:\.\w+)+)")
SCRIPT = re.compile(r"(?<![\w.-])python3? ((?:benchmarks|training|examples)/[\w/]+\.py)")


def console_scripts() -> dict[str, str]:
    """Console command -> ``module:function``, from pyproject.toml and benchmarks/pyproject.toml."""
    scripts = {}
    for path in (REPO / "pyproject.toml", REPO / "benchmarks" / "pyproject.toml"):
        scripts.update(tomllib.loads(path.read_text()).get("project", {}).get("scripts", {}))
    return scripts


def cited_commands() -> list[tuple[str, str]]:
    """Distinct ``(kind, target)`` the page's provenance lines run: ``module``, ``script`` or ``entry``."""
    text = (REPO / "results" / "RESULTS.md").read_text()
    entries = console_scripts()
    entry = re.compile(r"(?<![\w/.-])(%s)(?![\w-])" % "|".join(map(re.escape, sorted(entries, key=len, reverse=True))))
    found: dict[tuple[str, str], None] = {}
    for command in PROVENANCE.findall(text):
        for m in MODULE.finditer(command):
            found[("module", m.group(1))] = None
        for m in SCRIPT.finditer(command):
            found[("script", m.group(1))] = None
        for m in entry.finditer(command):
            found[("entry", entries[m.group(1)])] = None
    return list(found)


RUNNER = r"""
import contextlib, importlib, io, json, runpy, sys, traceback
results = {}
for kind, target in json.loads(sys.argv[1]):
    out = io.StringIO()
    argv = sys.argv
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            if kind == "entry":
                module, function = target.split(":")
                sys.argv = [target, "--help"]
                getattr(importlib.import_module(module), function)()
            elif kind == "module":
                sys.argv = [target, "--help"]
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                sys.argv = [target, "--help"]
                runpy.run_path(target, run_name="__main__")
        code = "no exit"
    except SystemExit as e:
        code = e.code or 0
    except BaseException:
        code = traceback.format_exc(limit=3)
    finally:
        sys.argv = argv
    text = out.getvalue()
    results[f"{kind} {target}"] = [code, "usage:" in text.lower(), text[-400:]]
print(json.dumps(results))
"""


def test_the_page_cites_modules_scripts_and_console_commands():
    kinds = {kind for kind, _ in cited_commands()}
    assert kinds == {"module", "script", "entry"}, kinds


def ask_for_help(commands: list[tuple[str, str]]) -> dict[str, list]:
    """``"kind target" -> [exit code or traceback, whether a usage line was printed, the output's tail]``."""
    res = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(commands)], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_a_command_that_is_gone_fails_the_check():
    results = ask_for_help([("module", "kvpop_lab.bench.no_such_module"), ("script", "benchmarks/not_there.py"),
                            ("entry", "kvpop_lab.testbed.evaluate:no_such_main")])
    assert all(code != 0 for code, _, _ in results.values()), results


def test_every_laboratory_command_on_the_results_page_answers_help():
    commands = cited_commands()
    results = ask_for_help(commands)
    assert len(results) == len(commands)
    failed = {name: r for name, r in results.items() if r[0] != 0 or not r[1]}
    assert not failed, "commands of results/RESULTS.md whose --help fails:\n" + "\n".join(
        f"{name}: exit {code!r}, usage printed: {usage}\n{out}" for name, (code, usage, out) in failed.items())
