"""Through train.py and the command line, on two ranks: a run started from a save_pretrained
GPT-2 (model.init_from) with data parallelism and with tensor parallelism takes its first step
from that model's loss, and `minddp export` of it loads in transformers with the run's logits."""

import pytest
import torch

from minddp.tools.sample import load as load_run
from minddp.train.data import ShardedBatches
from minddp.train.data.sources import load_data
from tests import hf_models
from tests.conftest import compose_config, metrics
from tests.launch import command, run_train

TINY = ["data=synthetic", "data.modulus=32", "model.block_size=16", "train.global_batch_size=8",
        "train.micro_batch_size=2", "train.eval_every=0", "optim.warmup_steps=1", "wandb.mode=disabled"]


def first_step_loss(folder, overrides, dp: int) -> float:
    """The HF model's loss on step 1's batch: every data-parallel rank's micro-batches."""
    from minddp.train.config import register

    register()
    cfg = compose_config(*overrides)
    train, _, _ = load_data(cfg.data, cfg.model.block_size, cfg.model.vocab_size)
    accum = cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp)
    batches = [b for rank in range(dp) for b in ShardedBatches(train, dp, rank, cfg.train.micro_batch_size,
                                                                accum, cfg.seed, torch.device("cpu")).get(0)]
    return hf_models.mean_loss(hf_models.load(folder), batches)


@pytest.mark.slow
@pytest.mark.parametrize("layout,dp", [("mesh.tp=1", 2), ("mesh.tp=2", 1)])
def test_init_from_on_two_ranks_then_export(tmp_path, layout, dp):
    folder = tmp_path / "gpt2"
    hf_models.saved(folder)
    overrides = [f"model.init_from={folder}", layout, *TINY, "train.max_steps=2", "train.ckpt_format=dcp"]
    run_train(tmp_path / "run", *overrides, nproc=2)
    rows = metrics(tmp_path / "run")
    assert rows[0]["step"] == 1
    assert rows[0]["loss"] == pytest.approx(first_step_loss(folder, overrides, dp), abs=hf_models.TOLERANCE)
    p = command(f"minddp export {tmp_path / 'run'} --to {tmp_path / 'out'}")
    assert p.returncode == 0 and "from_pretrained" in p.stdout, p.stderr
    ours, _, _ = load_run(tmp_path / "run")
    theirs = hf_models.load(tmp_path / "out")
    ids = hf_models.ids(length=16)
    assert (hf_models.logits(ours, ids) - hf_models.logits(theirs, ids)).abs().max() < hf_models.TOLERANCE


@pytest.mark.slow
def test_a_folder_whose_sizes_do_not_fit_stops_every_rank_with_one_line(tmp_path):
    folder = tmp_path / "gpt2"
    hf_models.saved(folder)
    p = run_train(tmp_path / "run", f"model.init_from={folder}", "model.n_embd=64", *TINY, nproc=2,
                  check=False)
    assert p.returncodes == [2, 2], p.stderr[-3000:]
    for rank in (0, 1):
        line = f"[rank {rank}] minddp: configuration error: model.init_from={folder} is a GPT-2 with"
        assert line in p.stderr, p.stderr[-3000:]
    assert "model.n_embd=64: drop that setting" in p.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_a_gpt2_vocabulary_on_byte_data_and_a_null_size_are_one_line_exit_2(tmp_path):
    """issue 56.5: a GPT-2 of vocabulary 50257 fine-tuned on data=text's byte ids; 56.4: a size of
    null in config.json was a Hydra traceback (exit 1)."""
    import json

    folder = tmp_path / "gpt2"
    hf_models.saved(folder, vocab_size=50_257)
    text = ["data=text", "data.max_bytes=20000", *TINY[2:]]
    p = run_train(tmp_path / "run", f"model.init_from={folder}", *text, check=False)
    assert p.returncodes == [2], p.stderr[-3000:]
    assert (f"[rank 0] minddp: configuration error: model.init_from={folder} has a vocabulary of 50257, but "
            "data=text's ids are bytes") in p.stderr, p.stderr[-3000:]
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "n_layer": None}))
    p = run_train(tmp_path / "run2", f"model.init_from={folder}", *TINY, check=False)
    assert p.returncodes == [2] and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "n_layer=None (sizes are positive integers)" in p.stderr, p.stderr[-3000:]
