"""The commit a figure names: FITDQN_COMMIT where the tree has no .git, else the checkout's (marked when its files
differ from it), else 'unknown'."""

import shutil
import subprocess

import pytest

from fitdqn import provenance


def test_the_variable_wins(monkeypatch):
    monkeypatch.setenv(provenance.COMMIT_VARIABLE, "abc1234")
    assert provenance.code_commit() == "abc1234"


def test_without_a_checkout_or_git_unknown(monkeypatch, tmp_path):
    monkeypatch.delenv(provenance.COMMIT_VARIABLE, raising=False)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 128, "", "not a repo"))
    assert provenance.code_commit() == "unknown"

    def no_git(*_args, **_kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(subprocess, "run", no_git)
    assert provenance.checkout_commit(tmp_path) == "unknown"


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_checkout_names_its_commit_and_marks_changed_files(tmp_path):
    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                              capture_output=True, text=True, check=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "code.py").write_text("a = 1\n")
    git("add", "code.py")
    git("commit", "-q", "-m", "first")
    head = git("rev-parse", "--short", "HEAD")
    assert provenance.checkout_commit(tmp_path) == head
    (tmp_path / "notes.txt").write_text("untracked files do not count\n")
    assert provenance.checkout_commit(tmp_path) == head
    (tmp_path / "code.py").write_text("a = 2\n")  # the tracked file no longer the commit's
    assert provenance.checkout_commit(tmp_path) == f"{head}+modified"
