"""model.init_from and minddp export on real runs of the trainer (in this process, world 1):
a run started from a save_pretrained GPT-2 takes its first step from that model's loss; a
resumed one takes its checkpoint; an export of a run (file or dcp folder checkpoints) loads in
transformers with the run's logits, beside one torch.save file; bad input is one line, exit 2."""

import json
import os

import pytest
import torch

from minddp.tools import export
from minddp.tools.sample import load as load_run
from minddp.train import checkpoint
from tests import hf_models
from tests.conftest import main_exit

SMALL_GPT = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=16"]
TINY = ["data=synthetic", "data.modulus=32", "train.global_batch_size=8", "train.micro_batch_size=4",
        "train.eval_every=0", "optim.warmup_steps=1"]


def gpt2_run(make, tmp_path, *overrides):
    """A trainer started from a small GPT-2 saved in tmp_path/gpt2 (activation gelu_new)."""
    folder = tmp_path / "gpt2"
    if not folder.exists():
        hf_models.saved(folder)
    return make(f"model.init_from={folder}", "model.block_size=16", *TINY, *overrides)


def test_a_run_from_a_gpt2_takes_its_first_step_from_that_models_loss(tmp_path, in_process_trainer):
    trainer = gpt2_run(in_process_trainer, tmp_path, "train.max_steps=2")
    trainer.setup()
    assert trainer.cfg.model.n_layer == 2 and trainer.cfg.model.activation == "gelu_tanh"
    batches = trainer.batches.get(0)  # step 1's micro-batches
    expected = hf_models.mean_loss(hf_models.load(tmp_path / "gpt2"), batches)
    assert trainer.train_step(1).loss == pytest.approx(expected, abs=hf_models.TOLERANCE)


def test_a_resumed_run_takes_its_checkpoint_not_the_folder(tmp_path, in_process_trainer):
    first = gpt2_run(in_process_trainer, tmp_path, "train.max_steps=2", "optim.lr=1e-2")
    first.setup()
    first.fit()
    trained = checkpoint.load(checkpoint.latest(first.run_dir), "cpu")["model"]
    again = gpt2_run(in_process_trainer, tmp_path, "train.max_steps=3", "optim.lr=1e-2", "train.resume=auto")
    again.setup()
    assert again.start == 2
    for name, value in again.model.state_dict().items():
        assert torch.equal(value, trained[name]), name
    folder_wte = hf_models.load(tmp_path / "gpt2").transformer.wte.weight
    assert not torch.equal(again.model.tok_emb.weight, folder_wte)  # trained on, not read again


@pytest.mark.parametrize("fmt", ["dcp", "file"])
def test_an_export_loads_in_transformers_with_the_runs_logits(tmp_path, in_process_trainer, capsys, fmt):
    """HF -> minddp (trained two steps) -> HF: transformers computes what minddp does."""
    trainer = gpt2_run(in_process_trainer, tmp_path, "train.max_steps=2", f"train.ckpt_format={fmt}")
    trainer.setup()
    trainer.fit()
    code, err = main_exit(export.main, capsys, trainer.run_dir, "--to", tmp_path / "out")
    assert code == 0, err
    ours, _, _ = load_run(trainer.run_dir)
    theirs = hf_models.load(tmp_path / "out")
    assert theirs.config.activation_function == "gelu_new" and theirs.config.n_positions == 16
    ids = hf_models.ids(length=16)
    assert (hf_models.logits(ours, ids) - hf_models.logits(theirs, ids)).abs().max() < hf_models.TOLERANCE
    one = torch.load(tmp_path / "out" / export.TORCH_FILE, weights_only=True)
    newest = checkpoint.latest(trainer.run_dir)
    saved = checkpoint.load(newest, "cpu")["model"]
    if fmt == "dcp":  # torch's dcp_to_torch_save: the folder's tensors under DCP's names
        assert all(torch.equal(one[f"model/{k}"], v) for k, v in saved.items() if k != "head.weight")
    else:  # the checkpoint file itself
        assert (tmp_path / "out" / export.TORCH_FILE).read_bytes() == newest.read_bytes()


def test_no_torch_file_writes_the_hugging_face_files_only(tmp_path, in_process_trainer, capsys):
    trainer = in_process_trainer(*SMALL_GPT, "train.max_steps=1", *TINY)
    trainer.setup()
    trainer.fit()
    code, err = main_exit(export.main, capsys, trainer.run_dir, "--to", tmp_path / "out", "--no-torch-file")
    assert code == 0, err
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["activation_function"] == "gelu"


# ---------------------------------------------------------------- bad input: one line, exit 2
def _refused(capsys, *argv) -> str:
    code, err = main_exit(export.main, capsys, *argv)
    assert code == 2 and err.count("\n") == 1 and err.startswith("minddp export: error: "), (code, err)
    return err


def test_a_run_without_a_complete_checkpoint_is_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints" / ".ckpt_00000002.tmp-1234").mkdir(parents=True)  # a save a crash cut short
    err = _refused(capsys, run, "--to", tmp_path / "out")
    assert "holds no complete checkpoint" in err and "train.ckpt_every" in err
    (run / "checkpoints" / "ckpt_00000002").mkdir()  # no integrity.json: not whole
    assert "no integrity.json" in _refused(capsys, run, "--to", tmp_path / "out")
    assert "does not exist" in _refused(capsys, tmp_path / "nothing", "--to", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_model_that_is_not_gpt_shaped_is_one_line(tmp_path, in_process_trainer, capsys):
    trainer = in_process_trainer("model=mlp", "train.max_steps=1", *TINY)
    trainer.setup()
    trainer.fit()
    err = _refused(capsys, trainer.run_dir, "--to", tmp_path / "out")
    assert "model=mlp is not GPT-shaped" in err and "dcp_to_torch" in err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_a_folder_in_the_way_is_one_line_and_left_alone(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    err = _refused(capsys, tmp_path, "--to", tmp_path / "out")
    assert "is not an empty folder" in err
    assert (tmp_path / "out" / "mine.txt").read_text() == "keep"


def test_an_export_that_fails_to_write_leaves_nothing(tmp_path, in_process_trainer, capsys, monkeypatch):
    trainer = in_process_trainer(*SMALL_GPT, "train.max_steps=1", *TINY)
    trainer.setup()
    trainer.fit()

    def full_disk(path, out):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "write_torch_file", full_disk)
    code, err = main_exit(export.main, capsys, trainer.run_dir, "--to", tmp_path / "out")
    assert code == 1 and "No space left on device" in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))
