"""data=tokens at its edges: every bad folder is a ConfigError naming the file and the fix, the
id check reads every token, llm.c headers are checked, formats are not mixed, and the
vocabulary is decided (and reported) the same way for nanoGPT, llm.c and build-nanogpt data."""


import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

import minddp
from tests.conftest import ROOT, TOK
from tests.files import llmc_folder, nanogpt
from tests.launch import free_port


# ------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_a_broken_folder_exits_2_on_every_rank_without_a_traceback(tmp_path):
    nanogpt(tmp_path / "d")
    (tmp_path / "d" / "train.bin").write_bytes(b"")
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node=2",
           "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}", str(ROOT / "train.py"),
           *TOK, "data=tokens", f"data.dir={tmp_path / 'd'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MINDDP_RUN_DIR": str(tmp_path / "run")}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode != 0
    for rank in (0, 1):
        assert f"[rank {rank}] minddp: configuration error: {tmp_path}/d/train.bin is empty" in out, out
    # torchrun's agent prints its own traceback (ChildFailedError); the workers print none
    package = os.path.dirname(os.path.abspath(minddp.__file__))  # not "/minddp/": a clone's own name
    assert package not in out and "train.py\", line" not in out and "flight recorder" not in out, out
    assert "exitcode  : 2" in out  # torchrun's report of the worker's exit code


def test_the_run_records_the_vocabulary_and_format_it_used(tmp_path, monkeypatch, caplog, in_process_trainer):
    """In process: llm.c GPT-2 shards, no model.vocab_size, a relative data.dir."""

    from minddp.train import checkpoint
    from minddp.train import trainer as trainer_mod

    llmc_folder(tmp_path / "shards", n=400)
    monkeypatch.chdir(tmp_path)
    seen = {}

    class Recording(trainer_mod.Tracker):
        def __init__(self, run_dir, config, *args, **kwargs):
            seen["wandb_config"] = config
            super().__init__(run_dir, config, *args, **kwargs)

    monkeypatch.setattr(trainer_mod, "Tracker", Recording)
    run = tmp_path / "run"
    t = in_process_trainer("data=tokens", "data.dir=shards", "model.n_layer=1", "model.n_embd=32",
                           "model.n_head=2", "model.block_size=16", "train.global_batch_size=8",
                           "train.micro_batch_size=4", "train.eval_every=0", "train.max_steps=2", run_dir=run)
    with caplog.at_level(logging.INFO, logger="minddp"):
        t.setup()
        t.checkpoints.save(0, last=True)  # what a save holds: the run's config as it ran
    folder = str(tmp_path / "shards")
    info = json.loads((run / "run.json").read_text())
    assert info["config"]["model"]["vocab_size"] == 50_257 and info["config"]["data"]["dir"] == folder
    assert info["data"]["format"] == "llm.c shards v1 (GPT-2)"
    assert info["data"]["tokens"] == {"train": 800, "val": 400}
    assert info["data"]["files"] == {"train": 2, "val": 1}
    assert seen["wandb_config"]["data_info"]["vocab_size"] == 50_257
    assert seen["wandb_config"]["model"]["vocab_size"] == 50_257
    saved = checkpoint.load(checkpoint.latest(run), "cpu")["config"]
    assert saved["model"]["vocab_size"] == 50_257 and saved["data"]["dir"] == folder
    startup = next(r.getMessage() for r in caplog.records if "parameters, world" in r.getMessage())
    assert info["data"]["dtype"] == "uint16"
    assert ("data llm.c shards v1 (GPT-2) uint16, 2 train + 1 val files, 800 train / 400 val tokens, "
            "vocabulary 50257 (llm.c header version 1 (GPT-2))") in startup, startup


@pytest.mark.slow
def test_a_bad_file_on_one_rank_exits_2_on_every_rank_within_seconds(tmp_path):
    nanogpt(tmp_path / "d0")
    (nanogpt(tmp_path / "d1") / "train.bin").write_bytes(b"\0" * 7)  # odd size: not uint16 tokens
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node=2",
           "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}", str(ROOT / "train.py"),
           *TOK, "data=tokens", f"data.dir={tmp_path}/d${{oc.env:RANK}}"]
    # unbuffered, as under many launchers: each rank's line must still be one write (CI once saw
    # "[rank 0] ...[rank 1] ..." on one line when print wrote the newline apart)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MINDDP_RUN_DIR": str(tmp_path / "run"),
           "PYTHONUNBUFFERED": "1"}
    t0 = __import__("time").monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    took, out = __import__("time").monotonic() - t0, p.stdout + p.stderr
    lines = sorted(x.split("] ", 1)[1] for x in out.splitlines() if "minddp: configuration error:" in x)
    assert len(lines) == 2 and lines[0] == lines[1] and "on rank 1" in lines[0], out[-3000:]
    assert "exitcode  : 1" not in out and "remote worker" not in out.lower(), out[-3000:]
    assert took < 25, took  # gloo's "remote worker crashing" took ~30 s before


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tokens", "text"])
def test_data_missing_on_one_rank_only_exits_2_on_every_rank_within_seconds(tmp_path, kind):
    """Rank 1's node lacks the folder (or file): found out after the process group exists, agreed,
    so every rank names it at once (checked before the group existed, rank 1 exited alone)."""
    from tests.launch import run_train

    if kind == "tokens":
        nanogpt(tmp_path / "d0")
        args = ["data=tokens", f"data.dir={tmp_path}/d${{oc.env:RANK}}"]
    else:
        (tmp_path / "d0").write_text("the quick brown fox jumps over the lazy dog. " * 200)
        args = ["data=text", f"data.path={tmp_path}/d${{oc.env:RANK}}"]
    t0 = __import__("time").monotonic()
    p = run_train(tmp_path / "run", *TOK, *args, nproc=2, check=False, timeout=120)
    took = __import__("time").monotonic() - t0
    assert p.returncodes == [2, 2], p.stderr[-3000:]
    missing = f"{tmp_path}/d1' " + ("is not a folder" if kind == "tokens" else "does not exist")
    for rank in (0, 1):
        assert f"[rank {rank}] minddp: configuration error: on rank 1 (1 of 2 ranks failed): " in p.stderr
    assert p.stderr.count(missing) == 2, p.stderr[-3000:]
    assert took < 20, took


@pytest.mark.slow
def test_resume_on_data_changed_under_the_same_folder_is_refused(tmp_path):
    from tests.launch import run_train

    d = nanogpt(tmp_path / "d", n_train=4000)
    args = [*TOK, "data=tokens", f"data.dir={d}", "train.max_steps=4", "train.ckpt_every=2"]
    run_train(tmp_path / "run", *args, "train.stop_at_step=2")
    ids = np.fromfile(d / "train.bin", dtype=np.uint16)
    (ids[::-1]).tofile(d / "train.bin")  # other content, same size and name
    p = run_train(tmp_path / "run", *args, "train.resume=auto", check=False, timeout=120)
    assert p.returncode == 2 and "other data than it was trained on: data fingerprint" in p.stderr, p.stderr
    p = run_train(tmp_path / "run", *args, "train.resume=auto", "train.resume_force=true", timeout=120)
    assert "changed on resume (train.resume_force=true): data fingerprint" in p.stdout + p.stderr
