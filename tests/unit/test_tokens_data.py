"""Bring your own data: nanoGPT's and llm.c's token files, prepare, sample, resume across dp."""


import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from minddp.errors import ConfigError
from minddp.train import data
from minddp.train.data import tokens
from tests.files import RunsCode, write_llmc, write_nanogpt


# ------------------------------------------------------------------ unit
def test_llmc_shards_concatenate_in_name_order_and_windows_never_span_two(tmp_path):
    write_llmc(tmp_path / "x_train_000002.bin", np.arange(100, 117))
    write_llmc(tmp_path / "x_train_000001.bin", np.arange(0, 10))
    write_llmc(tmp_path / "x_val_000000.bin", np.arange(5))
    layout, files = tokens.token_files(tmp_path)
    assert layout == "llmc"
    assert [f.name for f in files["train"]] == ["x_train_000001.bin", "x_train_000002.bin"]
    ds = data.TokenWindows([tokens.open_tokens(f) for f in files["train"]], block_size=4)
    # shard 1: 10 tokens -> 2 windows; shard 2: 17 tokens -> 4 windows
    assert len(ds) == 6
    assert ds[0].tolist() == [0, 1, 2, 3, 4] and ds[1].tolist() == [4, 5, 6, 7, 8]
    assert ds[2].tolist() == [100, 101, 102, 103, 104]  # starts the second shard
    assert ds.batch([1, 2]).tolist() == [ds[1].tolist(), ds[2].tolist()]


def test_llmc_header_decides_dtype_and_a_wrong_count_is_named(tmp_path):
    write_llmc(tmp_path / "a.bin", [70_000, 3], version=2)
    assert tokens.open_tokens(tmp_path / "a.bin").tolist() == [70_000, 3]
    write_llmc(tmp_path / "b.bin", np.arange(10), count=50)
    with pytest.raises(ConfigError, match="header says 50 tokens.*truncated"):
        tokens.open_tokens(tmp_path / "b.bin")


def test_headerless_dtype_auto_follows_the_vocabulary():
    assert tokens.headerless_dtype("auto", 50_257) == "uint16"
    assert tokens.headerless_dtype("auto", 100_000) == "uint32"
    assert tokens.headerless_dtype("uint8", 256) == "uint8"


def test_meta_pkl_is_read_without_running_code(tmp_path):
    write_nanogpt(tmp_path, meta=False)
    with open(tmp_path / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 65, "itos": {0: "a"}}, f)
    assert tokens.read_meta(tmp_path)["vocab_size"] == 65
    RunsCode.marker = tmp_path / "pwned"
    with open(tmp_path / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 65, "x": RunsCode()}, f)
    with pytest.raises(ConfigError, match="refused to load posix.system"):
        tokens.read_meta(tmp_path)
    assert not RunsCode.marker.exists()


def test_token_id_beyond_the_vocabulary_is_an_error_before_training(tmp_path):
    write_nanogpt(tmp_path, vocab=50)
    cfg = type("C", (), {"dir": str(tmp_path), "dtype": "auto"})
    data.load_tokens(cfg, 16, 50)
    bad = np.fromfile(tmp_path / "train.bin", dtype=np.uint16)
    bad[-3] = 77  # far from the start: found by the strided pass
    bad.tofile(tmp_path / "train.bin")
    with pytest.raises(ConfigError, match=r"holds token id 77 \(the first too large one at token 19997\) "
                                          "but the vocabulary has 50"):
        data.load_tokens(cfg, 16, 50)


def test_epoch_order_is_exactly_distributed_samplers():
    ds = data.ArithmeticSequences(101, 8, 7)
    for dp, rank in [(1, 0), (2, 1), (3, 2)]:
        b = data.ShardedBatches(ds, dp, rank, 2, 1, seed=5, device=torch.device("cpu"))
        s = DistributedSampler(ds, num_replicas=dp, rank=rank, shuffle=True, seed=5, drop_last=True)
        s.set_epoch(3)
        assert b.epoch_indices(3).tolist() == list(s)



@pytest.mark.parametrize("setup,message", [
    (lambda p: p.write_text(""), "holds no text"),
    (lambda p: p.write_bytes(b"\x00\x01binary"), "looks binary"),
])
def test_prepare_bad_input_is_a_clear_error(tmp_path, capsys, setup, message):
    from minddp.tools.prepare import main

    f = tmp_path / "in.txt"
    setup(f)
    with pytest.raises(SystemExit) as e:
        main([str(f), "--out", str(tmp_path / "o")])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_prepare_refuses_a_vocabulary_that_fits_no_dtype(tmp_path):
    from minddp.tools.prepare import PrepareError, dtype_for

    with pytest.raises(PrepareError, match="does not fit uint32"):
        dtype_for(2**33)
    assert dtype_for(65_536) == np.uint16 and dtype_for(65_537) == np.uint32


def test_text_cache_follows_the_files_content(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("hello world\n" * 10)
    first = data.load_corpus(str(src), 10_000, str(tmp_path / "cache"))
    assert bytes(first[:5]) == b"hello"
    (src / "a.txt").write_text("HELLO WORLD, edited\n" * 10)  # same path, new content
    second = data.load_corpus(str(src), 10_000, str(tmp_path / "cache"))
    assert bytes(second[:5]) == b"HELLO"
    assert len(list((tmp_path / "cache").glob("corpus-*.bin"))) == 2
    assert not list((tmp_path / "cache").glob(".corpus-*"))  # no temporary file left behind
