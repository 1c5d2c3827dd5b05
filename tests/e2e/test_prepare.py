"""minddp prepare: written aside and renamed into place, split by bytes (not lines), bad
arguments refused before anything is written (exit 2), OS errors a message (exit 1)."""


import os
import subprocess
import sys

import pytest

from minddp.tools import prepare as prep
from tests.conftest import main_exit
from tests.files import hidden_leftovers


# ------------------------------------------------------------------ memory
@pytest.mark.slow
def test_peak_memory_does_not_grow_with_line_length(tmp_path):
    """A one-line 30 MB corpus: peak RSS within a few MB of a 1 MB one (the old line-based
    split held the whole line, ~314 MB peak)."""
    peak = {}
    for name, size in (("small", 1 << 20), ("big", 30 << 20)):
        (tmp_path / f"{name}.txt").write_bytes(b"abcdefghij" * (size // 10))
        script = ("import resource, sys; from minddp.tools.prepare import main; "
                  "rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; "
                  "before = rss(); main(sys.argv[1:]); print(rss() - before)")
        p = subprocess.run([sys.executable, "-c", script, str(tmp_path / f"{name}.txt"), "--out",
                            str(tmp_path / name)], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, p.stderr[-2000:]
        peak[name] = int(p.stdout.split()[-1]) / 1024  # MB above the imports
    assert peak["big"] < 20 and peak["big"] - peak["small"] < 10, peak  # measured: 3 and 6 MB


# ------------------------------------------------------------------ what a killed prepare leaves
@pytest.mark.slow
def test_a_killed_prepares_temporary_is_removed_by_the_next_one(tmp_path, capsys):
    """kill -9 mid-run: the next prepare of the same --out removes the dead run's temporary
    folder (and keeps one whose process is still running)."""
    import signal
    import time

    corpus = tmp_path / "big.txt"
    corpus.write_text("".join(f"word{i % 5000} other{i % 777} text, " for i in range(400_000)))
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-m", "minddp", "prepare", str(corpus), "--out", str(out),
                          "--tokenizer", "bpe", "--vocab-size", "1000"], stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not hidden_leftovers(tmp_path) and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    stale = hidden_leftovers(tmp_path)
    assert len(stale) == 1 and f"-{p.pid}-" in stale[0], stale
    running = tmp_path / prep._temp_prefix(out, "prepare").rstrip("-")  # this process: alive
    running.mkdir()
    code, err = main_exit(prep.main, capsys, corpus, "--out", out)
    assert code == 0, err
    assert f"removed {tmp_path / stale[0]}, left by a prepare that did not finish" in err
    assert hidden_leftovers(tmp_path) == [running.name]


# ------------------------------------------------------------------ a vocabulary BPE cannot learn
@pytest.mark.parametrize("vocab,message", [
    (4294967296, "is more than the most minddp prepare trains (GPT-4's is about 100k): give --vocab-size <= "
                 "1048576"),
    (10**9, "give --vocab-size <= 1048576"),
    (100_000, "is more than BPE can learn from 3800 bytes of training text (256 + one merge per byte): give "
              "--vocab-size <= 4056"),
])
def test_a_vocabulary_bpe_cannot_learn_is_one_line_and_leaves_nothing(tmp_path, vocab, message):
    """issue 56.7: 2**32 and 10**9 aborted in the tokenizer trainer (SIGABRT, a Rust backtrace,
    exit 134) and left the temporary folder beside --out. A subprocess: the abort took pytest too."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat on the mat. " * 50_000 if vocab > 10**6 else "x" * 4000)  # 1.2 MB
    p = subprocess.run([sys.executable, "-m", "minddp", "prepare", str(corpus), "--out", str(tmp_path / "o"),
                        "--tokenizer", "bpe", "--vocab-size", str(vocab)], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and message in p.stderr, p.stderr[-2000:]
    assert sorted(q.name for q in tmp_path.iterdir()) == ["c.txt"]
