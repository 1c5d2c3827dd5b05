"""A run's identity: the commit is git's own answer (`git rev-parse`, a subprocess: this layer)."""

import pytest


@pytest.mark.slow  # starts git
def test_the_git_commit_is_gits_own_answer(tmp_path, monkeypatch):
    """`git rev-parse` of the checkout: a worktree and a detached head included; None outside a
    checkout, inside someone else's (an installed minddp under another repository), or without git."""
    import subprocess

    from minddp.train.metrics.identity import git_commit

    def git(*args):
        done = subprocess.run(["git", *args], cwd=tmp_path / "repo", check=True, capture_output=True,
                              text=True)
        return done.stdout.strip()

    assert git_commit(tmp_path) is None  # not a checkout
    (tmp_path / "repo" / "pkg").mkdir(parents=True)
    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "one")
    head = git("rev-parse", "HEAD")
    assert git_commit(tmp_path / "repo") == head and len(head) == 40
    assert git_commit(tmp_path / "repo" / "pkg") is None  # inside a checkout, not its top
    git("gc", "-q")  # packed refs
    git("worktree", "add", "-q", "--detach", str(tmp_path / "wt"))
    assert git_commit(tmp_path / "repo") == head == git_commit(tmp_path / "wt")
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))  # no git on PATH
    assert git_commit(tmp_path / "repo") is None
