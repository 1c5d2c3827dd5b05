"""minddp prepare: written aside and renamed into place, split by bytes (not lines), bad
arguments refused before anything is written (exit 2), OS errors a message (exit 1)."""

import errno
import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

from minddp.tools import prepare as prep
from minddp.train.data import prepare as pipeline


def run(capsys, *argv):
    """main(argv) in this process: (exit code, stderr)."""
    try:
        prep.main([str(a) for a in argv])
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def files_of(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def leftovers(parent):
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


@pytest.fixture
def corpus(tmp_path):
    f = tmp_path / "corpus.txt"
    f.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    return f


# ------------------------------------------------------------------ written aside, renamed in
def test_a_failed_run_leaves_the_old_output_untouched(tmp_path, corpus, capsys, monkeypatch):
    out = tmp_path / "out"
    assert run(capsys, corpus, "--out", out)[0] == 0
    before = files_of(out)
    corpus.write_text("something else entirely, and longer. " * 800)

    class DiskFullAfterOneWrite:  # numpy, except that the second array written hits a full disk
        calls = 0

        def __getattr__(self, name):
            return getattr(np, name)

        def asarray(self, *a, **k):
            DiskFullAfterOneWrite.calls += 1
            if DiskFullAfterOneWrite.calls == 2:
                raise OSError(errno.ENOSPC, "No space left on device", str(out / "val.bin"))
            return np.asarray(*a, **k)

    monkeypatch.setattr(pipeline, "np", DiskFullAfterOneWrite())
    code, err = run(capsys, corpus, "--out", out)
    assert code == 1 and "No space left on device" in err and f"{out} is unchanged" in err, err
    assert files_of(out) == before
    assert leftovers(tmp_path) == []  # the temporary folder is removed


def test_a_running_jobs_memory_mapped_file_keeps_its_old_contents(tmp_path, corpus, capsys):
    out = tmp_path / "out"
    assert run(capsys, corpus, "--out", out)[0] == 0
    job = np.memmap(out / "train.bin", dtype=np.uint16, mode="r")  # a job training from it
    old = np.array(job[:100])
    corpus.write_text("ZYXWVUTSRQ" * 4000)  # longer: no bus error even if written in place
    assert run(capsys, corpus, "--out", out)[0] == 0
    assert np.array_equal(job[:100], old)  # the old inode lives on under the job
    assert bytes(np.fromfile(out / "train.bin", dtype=np.uint16)[:10].astype(np.uint8)) == b"ZYXWVUTSRQ"
    assert leftovers(tmp_path) == []


def test_other_files_in_the_output_folder_are_kept(tmp_path, capsys):
    out = tmp_path / "shakespeare"
    out.mkdir()
    (out / "input.txt").write_text("To be, or not to be, that is the question. " * 100)
    (out / "prepare.py").write_text("# the user's own script\n")
    for _ in range(2):
        assert run(capsys, out / "input.txt", "--out", out)[0] == 0
    assert {p.name for p in out.iterdir()} == {"input.txt", "prepare.py", *prep.OUTPUTS}
    assert (out / "input.txt").read_text().startswith("To be, or not")


@pytest.mark.parametrize("where,message", [
    ("inside", "is inside the input folder"),
    ("subfolder", "holds folders (keep)"),
    ("file", "is a file, not a folder"),
    ("under a file", "out is a file, not a folder"),
])
def test_an_output_folder_that_cannot_be_replaced_is_refused(tmp_path, capsys, where, message):
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("hello world " * 100)
    out = {"inside": texts / "tok", "subfolder": tmp_path / "out", "file": tmp_path / "out",
           "under a file": tmp_path / "out" / "sub" / "tok"}[where]
    if where == "subfolder":
        (out / "keep").mkdir(parents=True)
    if where in ("file", "under a file"):
        (tmp_path / "out").write_text("x")
    code, err = run(capsys, texts, "--out", out)
    assert code == 2 and message in err, err


# ------------------------------------------------------------------ splits by bytes
def test_a_one_line_corpus_splits_by_bytes(tmp_path, capsys):
    text = "".join(chr(97 + (i * 7) % 26) for i in range(200_000))  # one line, no newline
    (tmp_path / "one.txt").write_text(text)
    assert run(capsys, tmp_path / "one.txt", "--out", tmp_path / "o", "--val-fraction", "0.1")[0] == 0
    train = np.fromfile(tmp_path / "o" / "train.bin", dtype=np.uint16)
    val = np.fromfile(tmp_path / "o" / "val.bin", dtype=np.uint16)
    assert (len(train), len(val)) == (180_000, 20_000)
    assert bytes(np.concatenate([train, val]).astype(np.uint8)).decode() == text


def test_bpe_splits_a_one_line_corpus_between_words(tmp_path, capsys):
    from tokenizers import Tokenizer

    words = ["alpha", "beta", "gamma", "delta", "épsilon", "zeta", "ηta"]
    text = " ".join(words[(i * 5) % 7] for i in range(60_000))  # ~360 KB, one line, non-ASCII too
    (tmp_path / "one.txt").write_text(text)
    code, err = run(capsys, tmp_path / "one.txt", "--out", tmp_path / "o", "--tokenizer", "bpe",
                    "--vocab-size", "300", "--val-fraction", "0.1")
    assert code == 0, err
    tok = Tokenizer.from_file(str(tmp_path / "o" / "tokenizer.json"))
    parts = [tok.decode(np.fromfile(tmp_path / "o" / f"{s}.bin", dtype=np.uint16).tolist())
             for s in ("train", "val")]
    assert parts[0] + parts[1] == text  # nothing lost or mangled at piece or split boundaries
    assert parts[1].startswith(" ") and 0.09 < len(parts[1].encode()) / len(text.encode()) < 0.11


def test_text_pieces_are_bounded_and_lossless():
    data = ("ab cd " * 1000 + "x" * 5000 + "é" * 3000).encode()
    chunks = [data[i : i + 700] for i in range(0, len(data), 700)]
    pieces = list(pipeline.text_pieces(chunks, limit=1000))
    assert "".join(pieces).encode() == data
    assert max(len(p.encode()) for p in pieces) <= 1000 and "\ufffd" not in "".join(pieces)


# ------------------------------------------------------------------ arguments
@pytest.mark.parametrize("fraction,message", [
    ("0", "--val-fraction must be strictly between 0 and 1, got 0.0"),
    ("1", "--val-fraction must be strictly between 0 and 1"),
    ("nan", "--val-fraction must be strictly between 0 and 1, got nan"),
    ("0.00001", "--val-fraction 1e-05 of 18000 bytes leaves val empty"),
])
def test_a_val_fraction_that_empties_a_split_is_refused_before_writing(tmp_path, corpus, capsys,
                                                                      fraction, message):
    code, err = run(capsys, corpus, "--out", tmp_path / "o", "--val-fraction", fraction)
    assert code == 2 and message in err, err
    assert not (tmp_path / "o").exists() and leftovers(tmp_path) == []


def test_vocab_size_with_the_bytes_tokenizer_is_an_error(tmp_path, corpus, capsys):
    code, err = run(capsys, corpus, "--out", tmp_path / "o", "--vocab-size", "512")
    assert code == 2 and "--vocab-size 512 does not apply to --tokenizer bytes" in err, err
    assert not (tmp_path / "o").exists()


def test_an_os_error_is_a_message_with_exit_1(corpus, capsys):
    code, err = run(capsys, corpus, "--out", "/proc/minddp-no-such-dir/out")  # /proc takes no folders
    assert code == 1, err
    assert err.startswith("minddp prepare: error: No such file or directory: /proc/minddp-no-such-dir; "
                          "/proc/minddp-no-such-dir/out is unchanged"), err


def test_outputs_are_what_data_tokens_and_sample_read(tmp_path, corpus, capsys):
    assert run(capsys, corpus, "--out", tmp_path / "o")[0] == 0
    with open(tmp_path / "o" / "meta.pkl", "rb") as f:
        assert pickle.load(f) == {"vocab_size": 256, "tokenizer": "bytes"}
    assert json.loads((tmp_path / "o" / "tokenizer.json").read_text()) == {"type": "bytes", "vocab_size": 256}


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
    while not leftovers(tmp_path) and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    stale = leftovers(tmp_path)
    assert len(stale) == 1 and f"-{p.pid}-" in stale[0], stale
    running = tmp_path / pipeline._temp_prefix(out, "prepare").rstrip("-")  # this process: alive
    running.mkdir()
    code, err = run(capsys, corpus, "--out", out)
    assert code == 0, err
    assert f"removed {tmp_path / stale[0]}, left by a prepare that did not finish" in err
    assert leftovers(tmp_path) == [running.name]


def test_an_out_that_is_a_symlink_stays_one_and_its_target_is_written(tmp_path, corpus, capsys):
    target = tmp_path / "real"
    target.mkdir()
    (target / "notes.txt").write_text("kept")
    link = tmp_path / "link"
    link.symlink_to(target)
    assert run(capsys, corpus, "--out", link)[0] == 0
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert {"train.bin", "val.bin", "meta.pkl", "tokenizer.json", "notes.txt"} <= set(files_of(target))
    assert leftovers(tmp_path) == []
