"""Never lose a run: resume that cannot lose progress, what a crash leaves behind, the
configuration a resume may change, and settings that are NaN or inf (issue 22)."""


import copy
import errno
import logging
import os

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from minddp.errors import ConfigError
from minddp.train import checkpoint
from minddp.train.config import register, validate
from tests.conftest import ROOT, compose_config, metrics
from tests.files import TINY_STATE, save_file, snapshot

register()


def _run_with_checkpoints(tmp_path, steps=(2, 4, 6)):
    for step in steps:
        save_file(tmp_path, step, {**TINY_STATE, "step": step})
    return [checkpoint.checkpoint_dir(tmp_path) / f"ckpt_{s:08d}.pt" for s in steps]


# ------------------------------------------------ item 1: resume cannot lose progress
def test_auto_with_every_checkpoint_unreadable_stops_naming_each_and_touching_none(tmp_path):
    paths = _run_with_checkpoints(tmp_path)
    paths[0].write_bytes(b"")  # empty
    paths[1].write_bytes(paths[2].read_bytes()[:700])  # truncated zip
    torch.save({"model": {}, "step": 6}, paths[2])  # readable, but keys missing
    before = snapshot(paths)
    with pytest.raises(ConfigError) as e:  # exit 2 in train.py, on every rank
        checkpoint.resolve(tmp_path, "auto", "cpu")
    text = str(e.value)
    assert "none of the 3 checkpoints" in text and "Nothing was changed" in text
    for p, why in zip(paths, ("EOFError", "failed finding central directory", "not a minddp checkpoint")):
        assert str(p) in text and why in text.split(str(p), 1)[1].splitlines()[0], (p, why, text)
    assert snapshot(paths) == before


def test_a_junk_newest_file_is_named_without_torchs_advice_to_drop_weights_only(tmp_path):
    paths = _run_with_checkpoints(tmp_path)
    paths[2].write_bytes(os.urandom(4096))  # not a zip: torch's refusal would advise weights_only=False
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.load(paths[2], "cpu")
    assert str(e.value) == (f"checkpoint {paths[2]} is unreadable (truncated or corrupt): "
                            "not a file torch.save wrote")
    path, state = checkpoint.resolve(tmp_path, "auto", "cpu")  # named in a warning, the previous one used
    assert path == paths[1] and state["step"] == 4


@pytest.mark.parametrize("error,raised", [
    (OSError(errno.EIO, "Input/output error"), "CheckpointReadError"),  # an OSError, named
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), torch.OutOfMemoryError),
    (MemoryError(), MemoryError),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), RuntimeError),
])
def test_a_transient_error_propagates_and_never_falls_back(tmp_path, monkeypatch, error, raised):
    paths = _run_with_checkpoints(tmp_path)
    before = snapshot(paths)
    tried = []

    def failing_load(path, **kwargs):
        tried.append(path)
        raise error

    monkeypatch.setattr(torch, "load", failing_load)
    raised = getattr(checkpoint, raised) if isinstance(raised, str) else raised
    with pytest.raises(raised) as e:
        checkpoint.resolve(tmp_path, "auto", "cpu")
    assert not isinstance(e.value, ConfigError)  # not a config error: exit 1, the run is intact
    assert tried == [paths[-1]]  # the newest only: ckpt 4 and 2 were never tried
    if raised is checkpoint.CheckpointReadError:
        assert str(paths[-1]) in str(e.value) and "no older checkpoint is used" in str(e.value)
    assert snapshot(paths) == before


def test_no_checkpoint_files_is_a_fresh_start(tmp_path):
    assert checkpoint.resolve(tmp_path, "auto", "cpu") == (None, None)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / ".ckpt_00000002.pt.x1y2.tmp").write_bytes(b"partial")
    assert checkpoint.resolve(tmp_path, "auto", "cpu") == (None, None)  # a temporary is no checkpoint


def test_a_fresh_start_refuses_a_run_dir_that_holds_checkpoints(tmp_path):
    paths = _run_with_checkpoints(tmp_path, (2,))
    before = snapshot(paths)
    with pytest.raises(ConfigError, match="train.resume=none, but the run dir .* holds 1 checkpoint.*"
                                          "train.resume=auto"):
        checkpoint.resolve(tmp_path, "none", "cpu")
    assert snapshot(paths) == before


def test_orphan_temporary_files_of_both_namings_are_removed_at_start_up(tmp_path):
    paths = _run_with_checkpoints(tmp_path, (2,))
    d = checkpoint.checkpoint_dir(tmp_path)
    orphans = [d / ".ckpt_00000004.pt.k3j_9x2a.tmp",  # atomic_open's name
               d / ".ckpt_00000004.pt.tmp12345-9f3a",  # minddp before atomic_open
               tmp_path / ".metrics.jsonl.abc123.tmp", tmp_path / ".run.json.abc123.tmp"]
    for p in orphans:
        p.write_bytes(b"x" * 1000)
    keep = [tmp_path / "notes.tmp", d / "ckpt_00000002.pt"]
    (tmp_path / "notes.tmp").write_text("mine")
    path, state = checkpoint.resolve_agreed(tmp_path, "auto", "cpu", into=lambda path, state: None)
    assert path == paths[0] and state["step"] == 2
    assert not any(p.exists() for p in orphans)
    assert all(p.exists() for p in keep)


# --------------------------------------------- item 2: what a crash leaves behind
def test_a_torn_last_metrics_line_is_dropped_and_reported(tmp_path, caplog):
    from minddp.train.metrics.tracking import Tracker

    rows = "".join(f'{{"step": {s}, "loss": 1.0}}\n' for s in range(1, 6))
    (tmp_path / "metrics.jsonl").write_text(rows + '{"step": 6, "lo')  # the disk filled mid-line
    with caplog.at_level(logging.WARNING, logger="minddp"):
        tracker = Tracker(tmp_path, {}, OmegaConf.create({"mode": "disabled"}), "t", 10, start_step=4)
    tracker.close()
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2, 3, 4]
    assert "dropped line 6, torn by an interrupted write" in caplog.text


@pytest.mark.parametrize("row", ['{"step": null, "loss": 1.0}', '{"step": "3"}', '{"step": 2.5}',
                                 '{"step": true}', '{"loss": 1.0}', "[3]"])
def test_a_metrics_row_without_an_integer_step_is_dropped_as_torn(tmp_path, caplog, row):
    """{"step": null} once stopped every resume with a TypeError (issue 56.6)."""
    from minddp.train.metrics.tracking import Tracker

    rows = [f'{{"step": {s}, "loss": 1.0}}' for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("\n".join([*rows[:2], row, *rows[2:]]) + "\n")
    with caplog.at_level(logging.WARNING, logger="minddp"):
        tracker = Tracker(tmp_path, {}, OmegaConf.create({"mode": "disabled"}), "t", 10, start_step=4)
    tracker.close()
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2, 3, 4]
    assert "dropped line 3, torn by an interrupted write" in caplog.text


def _full_disk_save(error: Exception | str):
    def save(obj, f):
        f.write(b"partial data")
        raise RuntimeError(error) if isinstance(error, str) else error
    return save


@pytest.mark.parametrize("error,said", [  # a full disk as the OS says it, and as torch's writer does
    (OSError(errno.ENOSPC, "No space left on device"), "No space left on device"),
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"), "unexpected pos"),
])
def test_a_full_disk_names_the_folder_and_free_space_and_keeps_the_previous_one(tmp_path, monkeypatch,
                                                                                 error, said):
    save_file(tmp_path, 1, {**TINY_STATE, "step": 1})
    monkeypatch.setattr(torch, "save", _full_disk_save(error))
    with pytest.raises(checkpoint.CheckpointWriteError) as e:
        save_file(tmp_path, 2, {**TINY_STATE, "step": 2})
    text, d = str(e.value), checkpoint.checkpoint_dir(tmp_path)
    assert f"MiB free in {d}" in text and said in text
    assert "previous checkpoint is intact (ckpt_00000001.pt)" in text
    monkeypatch.undo()
    assert [p.name for p in d.iterdir()] == ["ckpt_00000001.pt"]  # no temporary left either
    assert checkpoint.load(checkpoint.latest(tmp_path), "cpu")["step"] == 1


def test_a_runtime_error_that_is_not_the_write_is_not_called_a_full_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "save", _full_disk_save("can't pickle a generator"))
    with pytest.raises(RuntimeError, match="generator") as e:
        save_file(tmp_path, 2, {**TINY_STATE, "step": 2})
    assert not isinstance(e.value, checkpoint.CheckpointWriteError)


def test_the_ranks_error_line_is_printed_even_if_the_flight_recorder_dump_fails(tmp_path, monkeypatch,
                                                                                 capsys):
    from hydra.core.hydra_config import HydraConfig

    import train  # the repository root is on sys.path (tests/ is a package)
    from minddp.train.metrics import flight_recorder

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["data=synthetic", f"hydra.run.dir={tmp_path}"],
                      return_hydra_config=True)
    cfg.hydra.runtime.output_dir = str(tmp_path)
    HydraConfig.instance().set_config(cfg)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)

    def setup(self):
        raise checkpoint.CheckpointWriteError("could not write checkpoint: No space left on device")

    def dump(run_dir, reason):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(train.Trainer, "setup", setup)
    monkeypatch.setattr(flight_recorder, "dump", dump)
    with pytest.raises(checkpoint.CheckpointWriteError):
        train.main.__wrapped__(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]))
    err = capsys.readouterr().err
    assert "[rank 0] minddp: CheckpointWriteError: could not write checkpoint: No space left" in err, err
    assert "[rank 0] flight recorder: no dump (OSError" in err, err


# ----------------------------------------------- item 3: resume checks the configuration
def _config(*overrides):
    return OmegaConf.to_container(compose_config(*overrides), resolve=True)


def test_settings_that_break_an_exact_resume_are_refused_with_a_diff():
    from minddp.train.resume import check as resume_check

    saved = _config("data=synthetic")
    new = _config("data=synthetic", "seed=1", "model.n_embd=64", "train.global_batch_size=64",
                  "data.num_samples=100", "optim.lr=0.002", "train.max_steps=500", "train.resume=auto")
    refused, applied = resume_check.changes(saved, new)
    assert refused == ["data.num_samples: 4096 -> 100", "model.n_embd: 128 -> 64", "seed: 1337 -> 1",
                       "train.global_batch_size: 32 -> 64"]
    assert applied == ["optim.lr: 0.001 -> 0.002", "train.max_steps: 200 -> 500"]  # resume: not listed
    with pytest.raises(ConfigError, match=r"(?s)seed: 1337 -> 1.*train.resume_force=true"):
        resume_check.check(saved, new, False, "ckpt_00000004.pt")
    notes = resume_check.check(saved, new, True, "ckpt_00000004.pt")
    assert "changed on resume (train.resume_force=true): seed: 1337 -> 1" in notes
    assert "changed on resume, applied: optim.lr: 0.001 -> 0.002" in notes


def test_what_may_change_on_resume_is_applied(tmp_path):
    from minddp.train.resume import check as resume_check

    keep = ["train.micro_batch_size=4", "mesh.tp=2", "ddp.compress=bf16", "train.eval_every=7",
            "train.log_every=5", "optim.min_lr=0", "optim.warmup_steps=0", "optim.weight_decay=0",
            "optim.grad_clip=0.5", "wandb.mode=disabled", "train.ckpt_every=3", "data.cache_dir=/x"]
    refused, applied = resume_check.changes(_config(), _config(*keep))
    assert refused == [] and len(applied) == len(keep)
    # the same data folder, relative or absolute, is the same source
    rel = os.path.relpath(tmp_path)
    assert resume_check.changes({"data": {"dir": str(tmp_path)}}, {"data": {"dir": rel}}) == ([], [])
    assert resume_check.check(None, _config(), False, "old.pt")[0].endswith("settings not compared")


# --------------------------------------------------- item 4: non-finite settings
@pytest.mark.parametrize("override", [
    "optim.lr=inf", "optim.weight_decay=inf", "optim.min_lr=nan", "optim.grad_clip=nan", "optim.lr=nan",
    "ddp.bucket_cap_mb=nan", "train.timeout_s=nan", "train.init_timeout_s=inf", "optim.beta1=nan",
    "train.peak_tflops=nan", "model.dropout=nan", "train.fault_sleep_s=-inf", "optim.lr=-inf",
])
def test_a_non_finite_setting_is_a_config_error(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"{key}=-?(nan|inf) is not a finite number"):
        validate(compose_config(override), 1)


def _float_keys(node, prefix=""):
    for k, v in node.items():
        if isinstance(v, dict):
            yield from _float_keys(v, f"{prefix}{k}.")
        elif isinstance(v, float):
            yield f"{prefix}{k}"


@pytest.mark.parametrize("group", ["data=text", "data=synthetic", "model=mlp"])
def test_every_float_setting_of_every_group_rejects_nan_and_inf(group):
    cfg = compose_config(group, "ddp.bucket_cap_mb=25.0", "train.peak_tflops=1.0")  # optional floats set too
    keys = list(_float_keys(OmegaConf.to_container(cfg, resolve=True)))
    assert len(keys) >= 10, keys
    for key in keys:
        for value in (float("nan"), float("inf"), float("-inf")):
            bad = copy.deepcopy(cfg)
            OmegaConf.update(bad, key, value)
            with pytest.raises(ConfigError, match=f"{key}={value} is not a finite number"):
                validate(bad, 1)


def test_nan_cannot_slip_through_a_range_check():
    # the checks themselves are NaN-proof, not only the generic walk before them
    from minddp.train.config import _setting_problems

    for override in ("optim.lr=nan", "optim.grad_clip=nan", "ddp.bucket_cap_mb=nan", "train.timeout_s=nan"):
        assert list(_setting_problems(compose_config(override))), override
