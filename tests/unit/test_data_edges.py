"""data=tokens at its edges: every bad folder is a ConfigError naming the file and the fix, the
id check reads every token, llm.c headers are checked, formats are not mixed, and the
vocabulary is decided (and reported) the same way for nanoGPT, llm.c and build-nanogpt data."""


import pickle

import numpy as np
import pytest

from minddp.errors import ConfigError
from minddp.train import data
from minddp.train.data import tokens
from tests.files import llmc_folder, nanogpt, tokens_config, write_llmc


def load(folder, block_size=16, vocab=None, dtype="auto"):
    return data.load_tokens(tokens_config(folder, dtype), block_size, vocab)


# ------------------------------------------------------------------ broken files
def test_empty_train_bin_names_the_file(tmp_path):
    nanogpt(tmp_path)
    (tmp_path / "train.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"train\.bin is empty \(0 bytes\).*Re-run the script"):
        load(tmp_path)


def test_a_file_shorter_than_one_window_names_the_file_and_the_fix(tmp_path):
    nanogpt(tmp_path, n_val=10)
    with pytest.raises(ConfigError, match=r"val\.bin: the longest val file holds 10 tokens, fewer than one "
                                          r"window of model\.block_size\+1 = 17.*smaller model\.block_size"):
        load(tmp_path, block_size=16)


def test_train_bin_that_is_a_folder_is_named(tmp_path):
    nanogpt(tmp_path)
    (tmp_path / "train.bin").unlink()
    (tmp_path / "train.bin").mkdir()
    with pytest.raises(ConfigError, match=r"train\.bin is a folder, not a token file"):
        load(tmp_path)


@pytest.mark.parametrize("content", [
    pickle.dumps({"vocab_size": 50, "itos": {i: chr(65 + i) for i in range(50)}})[:-7],  # truncated
    b"not a pickle at all",
    b"",
])
def test_torn_or_foreign_meta_pkl_is_named(tmp_path, content):
    nanogpt(tmp_path)
    (tmp_path / "meta.pkl").write_bytes(content)
    with pytest.raises(ConfigError, match=r"meta\.pkl cannot be read .*truncated or not a pickle.*re-run"):
        load(tmp_path)


@pytest.mark.parametrize("meta", [{"vocab_size": "fifty"}, {"vocab_size": 0}, [1, 2]])
def test_meta_pkl_with_a_bad_vocab_size_is_named(tmp_path, meta):
    nanogpt(tmp_path)
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps(meta))
    with pytest.raises(ConfigError, match=r"meta\.pkl"):
        load(tmp_path)


# ------------------------------------------------------------------ the id check
def test_a_bad_id_anywhere_in_the_file_is_found(tmp_path):
    """1.5M tokens with one bad id between the old sampled chunks (first 1M + 256 runs of 4096)."""
    n = 1_500_000
    nanogpt(tmp_path, n_train=n, vocab=50)
    starts = [int(i * (n - 4096) / 255) for i in range(256)]
    bad_at = next(s for s in starts if s > 1_000_000) + 4096 + 100  # in a gap the sample skipped
    ids = np.fromfile(tmp_path / "train.bin", dtype=np.uint16)
    ids[bad_at] = 60
    ids.tofile(tmp_path / "train.bin")
    with pytest.raises(ConfigError, match=rf"train\.bin holds token id 60 \(the first too large one at "
                                          rf"token {bad_at}\) but the vocabulary has 50 tokens: the ids"):
        load(tmp_path)


def test_range_scan_is_exact_across_chunks(tmp_path):
    ids = np.arange(10_000, dtype=np.uint16) % 300
    ids[7_777] = 5_000
    path = tmp_path / "t.bin"
    ids.tofile(path)
    for chunk in (2, 1000, 4096, 1 << 20):  # bytes per read
        assert tokens.scan_range(path, np.uint16, 0, len(ids), chunk, limit=300) == (0, 5_000, 7_777)
    assert tokens.scan_range(path, np.uint16, 0, len(ids), 1000, limit=5_001) == (0, 5_000, None)


def test_the_error_advice_follows_where_the_vocabulary_came_from(tmp_path):
    nanogpt(tmp_path, vocab=300, meta=False)  # ids up to 299, nothing says the vocabulary
    with pytest.raises(ConfigError, match=r"no model\.vocab_size and no meta\.pkl gave one, so 256 was "
                                          r"assumed; set model\.vocab_size > 299"):
        load(tmp_path)
    with pytest.raises(ConfigError, match=r"set model\.vocab_size > 299, or check data\.dtype"):
        load(tmp_path, vocab=299)
    assert load(tmp_path, vocab=300)[2].vocab_size == 300


# ------------------------------------------------------------------ llm.c headers
@pytest.mark.parametrize("magic,version,message", [
    (12345, 1, r"magic number 12345, not llm\.c's 20240520: not an llm\.c shard"),
    (0, 0, r"the llm\.c header is all zeros"),
    (tokens.LLMC_MAGIC, 7, r"llm\.c header version 7 is unknown"),
])
def test_a_bad_llmc_header_is_an_error_not_plain_tokens(tmp_path, magic, version, message):
    llmc_folder(tmp_path)
    ids = np.arange(600) % 50
    if magic == 0:
        (tmp_path / "fw_train_000002.bin").write_bytes(np.zeros(256 + 600, dtype=np.int32).tobytes())
    else:
        write_llmc(tmp_path / "fw_train_000002.bin", ids, version=1, magic=magic)
        if version != 1:
            raw = bytearray((tmp_path / "fw_train_000002.bin").read_bytes())
            raw[4:8] = np.int32(version).tobytes()
            (tmp_path / "fw_train_000002.bin").write_bytes(bytes(raw))
    with pytest.raises(ConfigError, match=r"fw_train_000002\.bin: " + message):
        load(tmp_path)


def test_a_shard_shorter_than_its_header_is_named(tmp_path):
    llmc_folder(tmp_path)
    (tmp_path / "fw_val_000000.bin").write_bytes(b"\x01" * 100)
    with pytest.raises(ConfigError, match=r"fw_val_000000\.bin: 100 bytes, shorter than llm\.c's 1024-byte"):
        load(tmp_path)


@pytest.mark.parametrize("version,vocab,name", [(1, 50_257, "GPT-2"), (2, 128_256, "llama-3")])
def test_llmc_shards_default_to_their_tokenizers_vocabulary(tmp_path, version, vocab, name):
    llmc_folder(tmp_path, version)
    train, val, info = load(tmp_path)
    assert (info.vocab_size, info.vocab_source) == (vocab, f"llm.c header version {version} ({name})")
    assert info.format == f"llm.c shards v{version} ({name})"
    assert info.files == {"train": 2, "val": 1} and info.tokens == {"train": 600, "val": 300}
    assert len(train) == 2 * (299 // 16) and train[0].tolist() == list(range(17))
    assert load(tmp_path, vocab=50_304)[2].vocab_size == 50_304  # an explicit (padded) one wins


def test_llmc_versions_mixed_in_one_folder_are_named(tmp_path):
    llmc_folder(tmp_path, version=1)
    write_llmc(tmp_path / "fw_train_000003.bin", np.arange(100), version=2)
    with pytest.raises(ConfigError, match=r"fw_train_000001\.bin is llm\.c v1 but fw_train_000003\.bin is "
                                          r"llm\.c v2: one folder, one format"):
        load(tmp_path)


# ------------------------------------------------------------------ formats and vocabulary
@pytest.mark.parametrize("other,named", [
    ("fw_train_000001.bin", r"llm\.c shards \(\*_train_\*\.bin\): fw_train_000001\.bin"),
    ("edu_train_000001.npy", r"build-nanogpt shards \(\*_train_\*\.npy\): edu_train_000001\.npy"),
])
def test_two_formats_in_one_folder_name_both(tmp_path, other, named):
    nanogpt(tmp_path)
    if other.endswith(".npy"):
        np.save(tmp_path / other, np.arange(100, dtype=np.uint16))
    else:
        write_llmc(tmp_path / other, np.arange(100))
    with pytest.raises(ConfigError, match=r"holds two formats \(nanoGPT's train\.bin/val\.bin: train\.bin; "
                                          + named):
        load(tmp_path)


def test_an_explicit_vocab_size_that_disagrees_with_meta_pkl_names_both(tmp_path):
    nanogpt(tmp_path, vocab=65)
    with pytest.raises(ConfigError, match=r"model\.vocab_size=100 disagrees with .*meta\.pkl's "
                                          r"vocab_size 65"):
        load(tmp_path, vocab=100)
    assert load(tmp_path, vocab=65)[2].vocab_source == "model.vocab_size"
    info = load(tmp_path)[2]
    assert (info.vocab_size, info.vocab_source, info.format) == (65, "meta.pkl", "nanoGPT bin")


def test_build_nanogpt_npy_shards_are_read_memory_mapped(tmp_path):
    stream = np.arange(1000, dtype=np.uint16) % 64
    np.save(tmp_path / "edufineweb_val_000000.npy", stream[:200])
    np.save(tmp_path / "edufineweb_train_000001.npy", stream[200:600])
    np.save(tmp_path / "edufineweb_train_000002.npy", stream[600:])
    train, val, info = load(tmp_path, vocab=64)
    assert info.format == "npy shards (build-nanogpt)" and info.tokens == {"train": 800, "val": 200}
    assert isinstance(train.shards[0], np.memmap)
    assert train[0].tolist() == stream[200:217].tolist()
    assert train[len(train) - 1].tolist()[0] == stream[600 + 16 * (399 // 16 - 1)]  # the second shard
    bad = stream[600:].copy()
    bad[-1] = 64
    np.save(tmp_path / "edufineweb_train_000002.npy", bad)
    with pytest.raises(ConfigError, match=r"edufineweb_train_000002\.npy holds token id 64"):
        load(tmp_path, vocab=64)


@pytest.mark.parametrize("array,message", [
    (np.array([{"a": 1}], dtype=object), r"is not a readable \.npy array"),
    (np.zeros((4, 50), dtype=np.uint16), r"must be a 1-D integer array"),
    (np.linspace(0, 1, 100), r"must be a 1-D integer array"),
    (np.array([3, -1, 4] * 50, dtype=np.int32), r"holds a negative token id \(-1\)"),
])
def test_bad_npy_shards_are_named(tmp_path, array, message):
    np.save(tmp_path / "x_val_0.npy", np.arange(100, dtype=np.uint16))
    np.save(tmp_path / "x_train_0.npy", array, allow_pickle=True)
    with pytest.raises(ConfigError, match=r"x_train_0\.npy.*" + message):
        load(tmp_path, vocab=64)


def test_text_and_synthetic_data_check_the_vocabulary_too(tmp_path):
    from types import SimpleNamespace as NS

    (tmp_path / "a.txt").write_text("hello world\n" * 200)
    text = NS(name="text", path=str(tmp_path / "a.txt"), max_bytes=10_000, val_fraction=0.1,
              cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match=r"model\.vocab_size=100 is too small for data=text"):
        data.load_data(text, 16, 100)
    assert data.load_data(text, 16, None)[2].vocab_size == 256
    synthetic = NS(name="synthetic", num_samples=64, num_val=8, modulus=32)
    with pytest.raises(ConfigError, match=r"data\.modulus=32 exceeds model\.vocab_size=16"):
        data.load_data(synthetic, 16, 16)


def test_too_little_data_for_one_global_batch_or_no_text_is_a_config_error(tmp_path):
    from types import SimpleNamespace as NS

    import torch

    train, _, _ = load(nanogpt(tmp_path / "d", n_train=100), block_size=16)  # 6 windows
    with pytest.raises(ConfigError, match=r"the training set has 6 samples, fewer than one global "
                                          r"batch \(8\)"):
        data.ShardedBatches(train, 2, 0, 4, 1, seed=0, device=torch.device("cpu"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    text = NS(name="text", path=str(tmp_path / "empty"), max_bytes=1000, val_fraction=0.1,
              cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match=r"data\.path=.*empty' holds no text"):
        data.load_data(text, 16)


# ------------------------------------------ data fingerprints and rank agreement (issue 28)
def test_the_fingerprint_follows_the_bytes_not_the_folder(tmp_path):
    from minddp.train.data import fingerprint

    a = load(nanogpt(tmp_path / "a"))[2].fingerprint
    assert a and load(nanogpt(tmp_path / "b"))[2].fingerprint == a  # same files elsewhere: same data
    ids = np.fromfile(tmp_path / "b" / "train.bin", dtype=np.uint16)
    ids[200] = (ids[200] + 1) % 50  # one token, same size
    ids.tofile(tmp_path / "b" / "train.bin")
    assert load(tmp_path / "b")[2].fingerprint != a
    big = tmp_path / "big.bin"
    big.write_bytes(bytes(9 << 20))
    before = fingerprint.fingerprint([big])
    with open(big, "r+b") as f:
        f.seek(len(f.read()) - 10)
        f.write(b"x")
    assert fingerprint.fingerprint([big]) != before  # the tail of a big file is sampled


def test_resume_on_changed_data_is_refused_unless_forced():
    from minddp.train.resume import check as resume_check

    saved, now = {"fingerprint": "aaaa", "dir": "/d"}, {"fingerprint": "bbbb", "dir": "/d"}
    with pytest.raises(ConfigError, match=r"other data than it was trained on: data fingerprint aaaa -> bbbb "
                                          r"\(files of /d\).*train.resume_force=true"):
        resume_check.check_data(saved, now, False, "ckpt_4.pt")
    assert resume_check.check_data(saved, now, True, "ckpt_4.pt") == [
        "changed on resume (train.resume_force=true): data fingerprint aaaa -> bbbb (files of /d)"]
    assert resume_check.check_data(None, now, False, "old.pt") == []  # older checkpoints: not compared


def test_a_file_of_an_odd_size_shorter_than_a_header_is_named(tmp_path):
    (nanogpt(tmp_path / "d") / "train.bin").write_bytes(b"\0" * 7)
    with pytest.raises(ConfigError, match=r"train.bin: 7 bytes is not a whole number of uint16 tokens"):
        load(tmp_path / "d")
