"""Bring your own data: nanoGPT's and llm.c's token files, prepare, sample, resume across dp."""


import numpy as np
import pytest

from minddp.train import checkpoint
from minddp.train.data import tokens
from tests import launch
from tests.conftest import TOK, assert_same_curves, metrics
from tests.files import write_llmc, write_nanogpt
from tests.launch import run_train


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
    state = checkpoint.load(checkpoint.latest(tmp_path / "one"), "cpu")
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
