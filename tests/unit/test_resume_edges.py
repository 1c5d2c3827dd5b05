"""Resume that never surprises (issue 28): a run dir resumed by name, corrupt newest
checkpoints of every kind falling back, a dangling checkpoints link, a bound on skipped
steps, checksums, file modes, Ctrl-C, and `minddp debug` on malformed dumps."""


import errno
import logging
import os

import pytest
import torch
from omegaconf import OmegaConf

from minddp.errors import ConfigError
from minddp.io import atomic
from minddp.model.build import build_model
from minddp.train import checkpoint, resume
from minddp.train.build import build_optimizer
from minddp.train.checkpoint import integrity
from minddp.train.config import default_run_dir, register
from tests.conftest import SMALL, compose_config
from tests.files import corrupt, save_file

register()


def _cfg(*overrides):
    cfg = compose_config(*SMALL, *overrides)
    cfg.model.vocab_size = 256  # what record_in_config writes before any checkpoint is read
    return cfg


def _state(cfg, step: int) -> dict:
    """What the trainer saves: a real model, an AdamW that has stepped, RNG, config."""
    torch.manual_seed(step)
    model = build_model(cfg.model, 256)
    opt = build_optimizer(model, cfg.optim, torch.device("cpu"))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": {"last_epoch": step},
            "step": step, "rng": [{"cpu": torch.get_rng_state()}],
            "config": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)}  # as Trainer.run_config


@pytest.fixture(scope="module")
def cfg():
    return _cfg()


@pytest.fixture
def run(tmp_path, cfg):
    """A run dir with checkpoints at steps 2, 4, 6 (newest last)."""
    paths = [save_file(tmp_path, s, _state(cfg, s)) for s in (2, 4, 6)]
    return tmp_path, paths


def _accept(cfg):
    return resume.shape_check(cfg.model, build_model, 256)


# --------------------------------------------- 1. train.resume=<run dir>, one command
def test_resume_names_a_run_dir_or_its_checkpoints_folder(run, monkeypatch):
    run_dir, paths = run
    monkeypatch.delenv("MINDDP_RUN_DIR", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    for given in (run_dir, run_dir / "checkpoints"):
        assert checkpoint.resume_run_dir(str(given)) == run_dir
        assert default_run_dir("outputs", str(given)) == str(run_dir)  # Hydra's run dir: that run's
        path, state = checkpoint.resolve(run_dir, str(given), "cpu")
        assert path == paths[-1] and state["step"] == 6
    assert default_run_dir("outputs", "auto").startswith("outputs/")
    assert checkpoint.resume_run_dir(str(paths[0])) is None  # a file: resumed from, in a new run dir


def test_resume_of_another_run_dir_than_this_runs_is_refused(run, tmp_path_factory):
    run_dir, _ = run
    other = tmp_path_factory.mktemp("other")
    with pytest.raises(ConfigError, match=rf"train.resume={run_dir} continues the run dir {run_dir}, but "
                                          rf"this run writes to {other}"):
        checkpoint.resolve(other, str(run_dir), "cpu")


def test_resume_of_a_folder_without_checkpoints_says_so(tmp_path, caplog):
    with pytest.raises(ConfigError, match=r"no checkpoint in .*checkpoints: nothing to resume"):
        checkpoint.resolve(tmp_path, str(tmp_path), "cpu")
    with caplog.at_level(logging.INFO, logger="minddp"):
        assert checkpoint.resolve(tmp_path, "auto", "cpu") == (None, None)
    assert f"no checkpoint in {tmp_path / 'checkpoints'}: starting fresh" in caplog.text


def test_the_resume_command_keeps_the_overrides_and_the_launcher():
    argv = ["train.py", "model=mlp", "train.stop_at_step=3", "train.resume=auto", "train.fault_nan_step=2",
            "data.dir=/a b"]
    want = "python train.py model=mlp 'data.dir=/a b' train.resume=/r"
    assert resume.resume_command("/r", argv, {}) == want
    env = {"TORCHELASTIC_RUN_ID": "x", "GROUP_WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "4"}
    assert resume.resume_command("/r", argv[:2], env) == (
        "torchrun --standalone --nproc_per_node=4 train.py model=mlp train.resume=/r")
    env["GROUP_WORLD_SIZE"] = "2"
    assert resume.resume_command("/r", argv[:2], env).startswith("your launch command (on every node) with: ")


# ------------------------------------------ 2. a corrupt newest checkpoint falls back
KINDS = ["truncated:15000", "truncated:2000", "truncated:100", "random:0", "random:1", "random:2",
         "rng", "scheduler.last_epoch", "optimizer.param_groups", "optimizer.state", "model",
         "wrong shape", "wrong optimizer shape", "dangling symlink", "folder", "flipped bit"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_corrupt_newest_checkpoint_of_each_kind_falls_back(run, cfg, kind, caplog):
    run_dir, paths = run
    corrupt(paths[-1], kind)
    with caplog.at_level(logging.WARNING, logger="minddp"):
        path, state = checkpoint.resolve(run_dir, "auto", "cpu", _accept(cfg))
    assert path == paths[1] and state["step"] == 4, kind
    assert f"{paths[-1]}" in caplog.text and "trying the previous checkpoint" in caplog.text
    save_file(run_dir, 6, _state(cfg, 6))  # the run then saves step 6 again, whatever was there
    assert checkpoint.resolve(run_dir, "auto", "cpu", _accept(cfg))[0] == paths[-1]


def test_a_changed_model_config_is_left_to_the_config_diff_not_called_corrupt(run):
    run_dir, paths = run
    path, _ = checkpoint.resolve(run_dir, "auto", "cpu", _accept(_cfg("model.n_embd=32")))
    assert path == paths[-1]  # accepted here; resume_check then refuses it naming model.n_embd


def test_a_real_io_error_still_stops_without_falling_back(run):
    run_dir, paths = run
    paths[-1].unlink()
    paths[-1].symlink_to("/proc/self/mem")  # reading it is a real EIO
    with pytest.raises(checkpoint.CheckpointReadError, match="Input/output error"):
        checkpoint.resolve(run_dir, "auto", "cpu")


def test_einval_from_a_file_that_cannot_be_read_is_transient(tmp_path, monkeypatch):
    e = OSError(errno.EINVAL, "Invalid argument")
    assert not checkpoint.is_transient(e, __file__)  # the file reads fine: torch's parse failed
    assert checkpoint.is_transient(e, tmp_path / "missing.pt")
    assert checkpoint.is_transient(OSError(errno.EACCES, "Permission denied"), __file__)


# -------------------------------------------------- 3. a dangling checkpoints link
@pytest.mark.parametrize("mode", ["auto", "none"])
def test_a_dangling_checkpoints_link_is_refused_naming_it(tmp_path, mode):
    (tmp_path / "checkpoints").symlink_to(tmp_path / "unmounted" / "ckpts")
    with pytest.raises(ConfigError, match=rf"{tmp_path}/checkpoints is a symlink to .*unmounted/ckpts, which "
                                          "does not exist"):
        checkpoint.resolve(tmp_path, mode, "cpu")


def test_a_missing_resume_file_is_a_configuration_error_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=r"train.resume='/no/such.pt': no such checkpoint"):
        checkpoint.resolve(tmp_path, "/no/such.pt", "cpu")


# ------------------------------------------------------------- 5. checksums
@pytest.mark.slow  # thousands of loads: seconds
def test_every_bit_flip_is_detected_or_changes_nothing_loaded(tmp_path, cfg):
    path = save_file(tmp_path, 2, _state(cfg, 2))
    data = path.read_bytes()
    want = checkpoint.load(path, "cpu")
    silent, detected = [], 0
    for k in range(0, len(data) * 8, len(data) * 8 // 97):
        flipped = bytearray(data)
        flipped[k // 8] ^= 1 << (k % 8)
        path.write_bytes(bytes(flipped))
        try:
            got = checkpoint.load(path, "cpu")
        except checkpoint.CheckpointError:
            detected += 1
            continue
        if integrity.checksums(got) != integrity.checksums(want):
            silent.append(k)
    assert not silent, f"bit flips at {silent} loaded silently different data"
    assert detected > 80


def test_a_flipped_bit_in_a_tensor_is_named(tmp_path):
    state = {"model": {"w": torch.ones(1000)}, "optimizer": {"state": {}, "param_groups": []},
             "scheduler": {"last_epoch": 0}, "step": 1, "rng": [torch.get_rng_state()]}
    path = save_file(tmp_path, 1, state)
    data = bytearray(path.read_bytes())
    at = data.find(torch.ones(1000).numpy().tobytes())
    data[at + 2001] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match=r"checksum mismatch at /'model'/'w'"):
        checkpoint.load(path, "cpu")


# ------------------------------------------------------------------ 8. file modes
@pytest.mark.parametrize("mask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_written_files_follow_the_umask(tmp_path, mask, mode):
    old = os.umask(mask)
    try:
        ckpt = save_file(tmp_path, 1, {"step": 1})
        written = atomic.atomic_write(tmp_path / "run.json", "{}")
    finally:
        os.umask(old)
    assert ckpt.stat().st_mode & 0o777 == mode and written.stat().st_mode & 0o777 == mode
    written.chmod(0o640)  # a mode the user chose is kept when the file is replaced
    assert atomic.atomic_write(written, "{}").stat().st_mode & 0o777 == 0o640


def test_prepared_data_follows_the_umask(tmp_path):
    from minddp.tools import prepare

    (tmp_path / "in.txt").write_text("hello world\n" * 2000)
    old = os.umask(0o022)
    try:
        prepare.main([str(tmp_path / "in.txt"), "--out", str(tmp_path / "out"), "--tokenizer", "bytes"])
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "out" / "train.bin").stat().st_mode & 0o777 == 0o644


# ------------------------------------------------ 10. minddp debug on malformed dumps
@pytest.mark.parametrize("name,content", [
    ("flight_recorder/rank0", b"\x80\x04junk"), ("flight_recorder/rank0", b""),
    ("flight_recorder/rank1", b"\x80\x04}\x94."),  # a pickled empty dict: no entries
    ("flight_recorder_context/rank0.json", b"{not json"), ("flight_recorder_context/rank0.json", b"[1, 2]"),
])
def test_debug_on_a_malformed_dump_is_one_line(tmp_path, capsys, name, content):
    from minddp.tools import debug

    (tmp_path / name).parent.mkdir(parents=True)
    (tmp_path / name).write_bytes(content)
    with pytest.raises(SystemExit) as e:
        debug.main([str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"minddp debug: {tmp_path / name}: not" in err, err


def test_debug_on_a_missing_folder_is_one_line(tmp_path, capsys):
    from minddp.tools import debug

    with pytest.raises(SystemExit) as e:
        debug.main([str(tmp_path / "nope")])
    assert e.value.code == 2 and "does not exist" in capsys.readouterr().err
