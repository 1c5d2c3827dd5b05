"""minddp prepare: written aside and renamed into place, split by bytes (not lines), bad
arguments refused before anything is written (exit 2), OS errors a message (exit 1)."""


import errno
import json
import os
import pickle

import numpy as np
import pytest

from minddp.tools import prepare as prep
from tests.conftest import main_exit
from tests.files import hidden_leftovers


def files_of(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


# ------------------------------------------------------------------ written aside, renamed in
def test_a_failed_run_leaves_the_old_output_untouched(tmp_path, corpus, capsys, monkeypatch):
    out = tmp_path / "out"
    assert main_exit(prep.main, capsys, corpus, "--out", out)[0] == 0
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

    monkeypatch.setattr(prep, "np", DiskFullAfterOneWrite())
    code, err = main_exit(prep.main, capsys, corpus, "--out", out)
    assert code == 1 and "No space left on device" in err and f"{out} is unchanged" in err, err
    assert files_of(out) == before
    assert hidden_leftovers(tmp_path) == []  # the temporary folder is removed


def test_a_running_jobs_memory_mapped_file_keeps_its_old_contents(tmp_path, corpus, capsys):
    out = tmp_path / "out"
    assert main_exit(prep.main, capsys, corpus, "--out", out)[0] == 0
    job = np.memmap(out / "train.bin", dtype=np.uint16, mode="r")  # a job training from it
    old = np.array(job[:100])
    corpus.write_text("ZYXWVUTSRQ" * 4000)  # longer: no bus error even if written in place
    assert main_exit(prep.main, capsys, corpus, "--out", out)[0] == 0
    assert np.array_equal(job[:100], old)  # the old inode lives on under the job
    assert bytes(np.fromfile(out / "train.bin", dtype=np.uint16)[:10].astype(np.uint8)) == b"ZYXWVUTSRQ"
    assert hidden_leftovers(tmp_path) == []


def test_other_files_in_the_output_folder_are_kept(tmp_path, capsys):
    out = tmp_path / "shakespeare"
    out.mkdir()
    (out / "input.txt").write_text("To be, or not to be, that is the question. " * 100)
    (out / "prepare.py").write_text("# the user's own script\n")
    for _ in range(2):
        assert main_exit(prep.main, capsys, out / "input.txt", "--out", out)[0] == 0
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
    code, err = main_exit(prep.main, capsys, texts, "--out", out)
    assert code == 2 and message in err, err


# ------------------------------------------------------------------ splits by bytes
def test_a_one_line_corpus_splits_by_bytes(tmp_path, capsys):
    text = "".join(chr(97 + (i * 7) % 26) for i in range(200_000))  # one line, no newline
    (tmp_path / "one.txt").write_text(text)
    code, err = main_exit(prep.main, capsys, tmp_path / "one.txt", "--out", tmp_path / "o",
                          "--val-fraction", "0.1")
    assert code == 0, err
    train = np.fromfile(tmp_path / "o" / "train.bin", dtype=np.uint16)
    val = np.fromfile(tmp_path / "o" / "val.bin", dtype=np.uint16)
    assert (len(train), len(val)) == (180_000, 20_000)
    assert bytes(np.concatenate([train, val]).astype(np.uint8)).decode() == text


def test_bpe_splits_a_one_line_corpus_between_words(tmp_path, capsys):
    from tokenizers import Tokenizer

    words = ["alpha", "beta", "gamma", "delta", "épsilon", "zeta", "ηta"]
    text = " ".join(words[(i * 5) % 7] for i in range(60_000))  # ~360 KB, one line, non-ASCII too
    (tmp_path / "one.txt").write_text(text)
    code, err = main_exit(prep.main, capsys, tmp_path / "one.txt", "--out", tmp_path / "o",
                          "--tokenizer", "bpe", "--vocab-size", "300", "--val-fraction", "0.1")
    assert code == 0, err
    tok = Tokenizer.from_file(str(tmp_path / "o" / "tokenizer.json"))
    parts = [tok.decode(np.fromfile(tmp_path / "o" / f"{s}.bin", dtype=np.uint16).tolist())
             for s in ("train", "val")]
    assert parts[0] + parts[1] == text  # nothing lost or mangled at piece or split boundaries
    assert parts[1].startswith(" ") and 0.09 < len(parts[1].encode()) / len(text.encode()) < 0.11


def test_text_pieces_are_bounded_and_lossless():
    data = ("ab cd " * 1000 + "x" * 5000 + "é" * 3000).encode()
    chunks = [data[i : i + 700] for i in range(0, len(data), 700)]
    pieces = list(prep.text_pieces(chunks, limit=1000))
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
    code, err = main_exit(prep.main, capsys, corpus, "--out", tmp_path / "o", "--val-fraction", fraction)
    assert code == 2 and message in err, err
    assert not (tmp_path / "o").exists() and hidden_leftovers(tmp_path) == []


def test_vocab_size_with_the_bytes_tokenizer_is_an_error(tmp_path, corpus, capsys):
    code, err = main_exit(prep.main, capsys, corpus, "--out", tmp_path / "o", "--vocab-size", "512")
    assert code == 2 and "--vocab-size 512 does not apply to --tokenizer bytes" in err, err
    assert not (tmp_path / "o").exists()


def test_an_os_error_is_a_message_with_exit_1(corpus, capsys):
    # /proc takes no folders
    code, err = main_exit(prep.main, capsys, corpus, "--out", "/proc/minddp-no-such-dir/out")
    assert code == 1, err
    assert err.startswith("minddp prepare: error: No such file or directory: /proc/minddp-no-such-dir; "
                          "/proc/minddp-no-such-dir/out is unchanged"), err


def test_outputs_are_what_data_tokens_and_sample_read(tmp_path, corpus, capsys):
    assert main_exit(prep.main, capsys, corpus, "--out", tmp_path / "o")[0] == 0
    with open(tmp_path / "o" / "meta.pkl", "rb") as f:
        assert pickle.load(f) == {"vocab_size": 256, "tokenizer": "bytes"}
    assert json.loads((tmp_path / "o" / "tokenizer.json").read_text()) == {"type": "bytes", "vocab_size": 256}


def test_an_out_that_is_a_symlink_stays_one_and_its_target_is_written(tmp_path, corpus, capsys):
    target = tmp_path / "real"
    target.mkdir()
    (target / "notes.txt").write_text("kept")
    link = tmp_path / "link"
    link.symlink_to(target)
    assert main_exit(prep.main, capsys, corpus, "--out", link)[0] == 0
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert {"train.bin", "val.bin", "meta.pkl", "tokenizer.json", "notes.txt"} <= set(files_of(target))
    assert hidden_leftovers(tmp_path) == []
