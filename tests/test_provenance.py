"""git_commit: $KVPOP_GIT_COMMIT, else `git rev-parse HEAD` where asked, else "unknown"."""

import os
import shutil
import subprocess

import pytest

from kvpop_lab.utils.provenance import git_commit

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs the git executable")


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
