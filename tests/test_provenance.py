"""The commit a figure names: FITDQN_COMMIT where the tree has no .git, else the checkout's, else 'unknown'."""

import subprocess

from fitdqn import provenance


def test_the_variable_wins(monkeypatch):
    monkeypatch.setenv(provenance.COMMIT_VARIABLE, "abc1234")
    assert provenance.code_commit() == "abc1234"


def test_the_checkout_else_unknown(monkeypatch):
    monkeypatch.delenv(provenance.COMMIT_VARIABLE, raising=False)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, "d0ce3cf\n", ""))
    assert provenance.code_commit() == "d0ce3cf"
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 128, "", "not a repo"))
    assert provenance.code_commit() == "unknown"

    def no_git(*_args, **_kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(subprocess, "run", no_git)
    assert provenance.code_commit() == "unknown"
