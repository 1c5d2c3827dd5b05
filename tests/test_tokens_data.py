"""Bring your own data: nanoGPT's and llm.c's token files, prepare, sample, resume across dp."""

import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from minddp.errors import ConfigError
from minddp.train import data
from minddp.train.data import tokens
from tests import launch
from tests.conftest import SMALL, assert_same_curves, metrics
from tests.launch import run_train

TOK = [a for a in SMALL if not a.startswith("data=")]


def write_nanogpt(folder, vocab=50, n_train=20_000, n_val=4_000, meta=True, seed=0):
    folder.mkdir(parents=True, exist_ok=True)
    g = np.random.default_rng(seed)
    # a learnable stream: runs of an arithmetic progression mod vocab
    base = np.cumsum(g.integers(1, 4, size=n_train + n_val)) % vocab
    base[: n_train].astype(np.uint16).tofile(folder / "train.bin")
    base[n_train:].astype(np.uint16).tofile(folder / "val.bin")
    if meta:
        with open(folder / "meta.pkl", "wb") as f:
            pickle.dump({"vocab_size": vocab}, f)
    return base


def write_llmc(path, ids, version=1, count=None):
    header = np.zeros(256, dtype=np.int32)
    header[:3] = [tokens.LLMC_MAGIC, version, len(ids) if count is None else count]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(ids, dtype=np.uint16 if version == 1 else np.uint32).tobytes())


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


class _RunsCode:
    def __reduce__(self):
        import os

        return (os.system, (f"touch {_RunsCode.marker}",))


def test_meta_pkl_is_read_without_running_code(tmp_path):
    write_nanogpt(tmp_path, meta=False)
    with open(tmp_path / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 65, "itos": {0: "a"}}, f)
    assert tokens.read_meta(tmp_path)["vocab_size"] == 65
    _RunsCode.marker = tmp_path / "pwned"
    with open(tmp_path / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 65, "x": _RunsCode()}, f)
    with pytest.raises(ConfigError, match="refused to load posix.system"):
        tokens.read_meta(tmp_path)
    assert not _RunsCode.marker.exists()


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


# ------------------------------------------------------------ end to end
@pytest.mark.slow
def test_nanogpt_folder_trains_with_the_same_losses_on_1_and_2_ranks(tmp_path):
    write_nanogpt(tmp_path / "d", vocab=50)
    args = [*TOK, "data=tokens", f"data.dir={tmp_path / 'd'}", "train.max_steps=6"]
    run_train(tmp_path / "one", *args)
    run_train(tmp_path / "two", *args, nproc=2)
    one = metrics(tmp_path / "one")
    assert_same_curves(metrics(tmp_path / "two"), one)
    assert one[-1]["loss"] < one[0]["loss"] - 0.3  # it learns (ln 50 = 3.9 at the start)
    state = torch.load(sorted((tmp_path / "one" / "checkpoints").glob("*.pt"))[-1], weights_only=True)
    assert state["model"]["tok_emb.weight"].shape[0] == 50  # vocab_size from meta.pkl


@pytest.mark.slow
def test_llmc_shards_train(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    stream = write_nanogpt(tmp_path / "tmp", vocab=64)
    write_llmc(d / "fineweb_train_000001.bin", stream[:9000])
    write_llmc(d / "fineweb_train_000002.bin", stream[9000:20000])
    write_llmc(d / "fineweb_val_000000.bin", stream[20000:])
    run_train(tmp_path / "run", *TOK, "data=tokens", f"data.dir={d}", "model.vocab_size=64",
              "train.max_steps=6", nproc=2)
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[0]["loss"] == pytest.approx(np.log(64), abs=0.15)  # untrained: uniform over 64 ids
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.3, rows  # it learns the shards' stream
    assert rows[-1]["val_loss"] < rows[0]["loss"] - 0.3  # evaluated on the val shard, learned too


@pytest.mark.slow
def test_resident_memory_does_not_grow_with_the_file(tmp_path):
    rss = {}
    for name, n in (("small", 1_000_000), ("big", 150_000_000)):  # 2 MB and 300 MB
        d = tmp_path / name
        d.mkdir()
        np.memmap(d / "train.bin", dtype=np.uint16, mode="w+", shape=(n,)).flush()  # zeros, sparse
        np.zeros(10_000, dtype=np.uint16).tofile(d / "val.bin")
        run_train(tmp_path / f"run-{name}", *TOK, "data=tokens", f"data.dir={d}", "model.vocab_size=64",
                  "model.block_size=256", "train.max_steps=3", "train.eval_every=0")
        rss[name] = metrics(tmp_path / f"run-{name}")[-1]["mem/peak_rss_mb"]
    assert rss["big"] - rss["small"] < 30, rss  # MB; the file is 300 MB


@pytest.mark.slow
def test_resume_on_another_number_of_ranks_continues_the_same_samples(tmp_path):
    write_nanogpt(tmp_path / "d", vocab=50)
    args = [*TOK, "data=tokens", f"data.dir={tmp_path / 'd'}", "train.max_steps=9", "train.ckpt_every=3",
            "train.eval_every=0"]
    run_train(tmp_path / "ref", *args, nproc=2)
    run = tmp_path / "run"
    run_train(run, *args, "train.stop_at_step=3", nproc=2)
    run_train(run, *args, "train.stop_at_step=6", "train.resume=auto", nproc=1)
    run_train(run, *args, "train.resume=auto", nproc=2)
    assert_same_curves(metrics(run), metrics(tmp_path / "ref"), atol=1e-5)
    assert [r["samples_seen"] for r in metrics(run)] == [16 * s for s in range(1, 10)]


@pytest.mark.slow
def test_prepare_train_sample_end_to_end(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the quick brown fox jumps over the lazy dog.\n" * 400)
    (corpus / "b.txt").write_text("pack my box with five dozen liquor jugs!\n" * 400)
    (corpus / "img.bin").write_bytes(b"\0\1\2" * 100)  # binaries in a folder are skipped
    for tok in ("bytes", "bpe"):
        out = tmp_path / f"data-{tok}"
        bpe = ["--vocab-size", "300"] if tok == "bpe" else []
        p = launch.script(["-m", "minddp", "prepare", str(corpus), "--out", str(out), "--tokenizer", tok,
                        "--val-fraction", "0.1", *bpe], timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        assert {f.name for f in out.iterdir()} >= {"train.bin", "val.bin", "meta.pkl", "tokenizer.json"}
        vocab = tokens.read_meta(out)["vocab_size"]
        assert vocab == (256 if tok == "bytes" else 300)
        run = tmp_path / f"run-{tok}"
        run_train(run, *TOK, "data=tokens", f"data.dir={out}", "train.max_steps=30", "optim.lr=3e-3",
                  "train.eval_every=0")
        s = launch.script(["-m", "minddp", "sample", str(run), "--prompt", "the quick", "--tokens", "20",
                        "--temperature", "0"], timeout=120)
        assert s.returncode == 0, s.stderr[-2000:]
        assert s.stdout.startswith("the quick") and len(s.stdout) > len("the quick") + 5, s.stdout


@pytest.mark.slow  # a subprocess: the CLI's exit code and stderr
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
    from minddp.train.data.prepare import PrepareError, dtype_for

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
