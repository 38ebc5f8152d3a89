"""git_commit: $KVPOP_GIT_COMMIT, else `git rev-parse HEAD` where asked, else "unknown"."""

import os
import shutil
import subprocess

import pytest

from kvpop_lab.utils.provenance import git_commit

pytestmark = [pytest.mark.tier("scripts"), pytest.mark.skipif(shutil.which("git") is None, reason="needs the git executable")]


def _repo(path):
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    path.mkdir()
    (path / "f.txt").write_text("x")
    for cmd in (["init", "-q"], ["add", "f.txt"], ["commit", "-qm", "c"]):
        subprocess.run(["git", *cmd], cwd=path, check=True, env={**os.environ, **env})
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_head_of_the_repository_holding_a_file_or_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("KVPOP_GIT_COMMIT", raising=False)
    sha = _repo(tmp_path / "repo")
    assert len(sha) == 40
    assert git_commit(tmp_path / "repo") == sha
    assert git_commit(tmp_path / "repo" / "f.txt") == sha
    assert git_commit(str(tmp_path / "repo")) == sha


def test_environment_override_wins(tmp_path, monkeypatch):
    _repo(tmp_path / "repo")
    monkeypatch.setenv("KVPOP_GIT_COMMIT", "abc123")
    assert git_commit(tmp_path / "repo") == "abc123"
    assert git_commit(tmp_path) == "abc123"


def test_unknown_outside_a_repository_or_without_git(tmp_path, monkeypatch):
    monkeypatch.delenv("KVPOP_GIT_COMMIT", raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # no repository above tmp_path counts
    (tmp_path / "plain").mkdir()
    assert git_commit(tmp_path / "plain") == "unknown"
    sha_dir = tmp_path / "repo"
    _repo(sha_dir)
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    assert git_commit(sha_dir) == "unknown"


def test_gpu_scripts_name_a_changed_tree_head_plus_changes(tmp_path):
    """benchmarks/gpu/commit_env.sh (sourced by every GPU script): a tree whose tracked files differ from HEAD is
    named HEAD+changes, with a note; a clean tree, a KVPOP_GIT_COMMIT already set and a folder outside git keep theirs."""
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "commit_env.sh"
    env = {k: v for k, v in os.environ.items() if k != "KVPOP_GIT_COMMIT"}
    env["GIT_CEILING_DIRECTORIES"] = str(tmp_path)

    def named(folder, **extra):
        r = subprocess.run(["bash", "-c", f'source "{script}"; echo "[${{KVPOP_GIT_COMMIT:-}}]"'], cwd=folder,
                           env={**env, **extra}, capture_output=True, text=True, check=True)
        return r.stdout.strip(), r.stderr

    sha = _repo(tmp_path / "repo")
    assert named(tmp_path / "repo") == ("[]", "")
    (tmp_path / "repo" / "f.txt").write_text("changed")
    name, note = named(tmp_path / "repo")
    assert name == f"[{sha}+changes]" and "differ from HEAD" in note
    assert named(tmp_path / "repo", KVPOP_GIT_COMMIT="abc123")[0] == "[abc123]"
    (tmp_path / "plain").mkdir()
    assert named(tmp_path / "plain") == ("[]", "")
