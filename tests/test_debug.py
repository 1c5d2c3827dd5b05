"""Never hang, never lose work: fingerprints, flight recorder, consistency, bad input."""

import json
import os
import subprocess
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from minddp.errors import ConfigError
from minddp.parallel.dist import env_ranks
from minddp.train import checkpoint, consistency, flight_recorder
from tests import multiproc
from tests.conftest import SMALL, assert_same_curves, final_model, metrics, run_train


# ------------------------------------------- fingerprints (torch's DETAIL mode)
def _mismatch(rank, world_size):
    flight_recorder.enable_fingerprints()
    checked = dist.new_group(timeout=timedelta(seconds=20))  # groups created from now on are checked
    dist.all_reduce(torch.ones(2), group=checked)  # #1 agrees
    if rank == 0:
        dist.all_reduce(torch.ones(4), group=checked)
    else:
        dist.broadcast(torch.ones(8), src=0, group=checked)


def test_collective_mismatch_names_ranks_and_both_calls():
    errors = multiproc.run_expect_errors(_mismatch, 2, timeout=60)
    for text in errors.values():
        assert "Detected mismatch between collectives" in text
        assert "OpType=ALLREDUCE, TensorShape=[4]" in text and "OpType=BROADCAST, TensorShape=[8]" in text


FR_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DUMP_ON_TIMEOUT")


def test_configure_turns_on_torchs_recorder_and_never_overrides_an_export(tmp_path, monkeypatch):
    for name in FR_VARS:  # set then deleted, so that monkeypatch restores the original state
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    flight_recorder.configure(0, tmp_path)  # train.flight_recorder=0: nothing set
    assert not any(name in os.environ for name in FR_VARS) and not flight_recorder.recording()
    flight_recorder.configure(100, tmp_path)
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "100" and flight_recorder.recording()
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "flight_recorder" / "watchdog_rank")
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert (tmp_path / "flight_recorder").is_dir()  # nccl's watchdog may write there before any dump
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "7")
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", "/elsewhere/fr")
    flight_recorder.configure(2000, tmp_path / "other")
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "7"
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == "/elsewhere/fr"


# ------------------------------------------------- torch's flight recorder
def _hang(rank, world_size, run_dir, late_s=None):
    """Rank 0 waits in #4 until its 2 s timeout; rank 1 never calls it, or (late_s) calls it
    only that long after (a stall that ends before anyone kills the rank)."""
    import time

    short = dist.new_group(timeout=timedelta(seconds=2))
    flight_recorder.register_groups(short)
    flight_recorder.set_context(step=7, phase="test")
    try:
        for _ in range(3):
            dist.all_reduce(torch.ones(3), group=short)
        if rank == 1 and late_s:
            time.sleep(late_s)
        if rank == 0 or late_s:
            dist.all_reduce(torch.ones(5), group=short)  # rank 1 never comes (in time): times out
    except RuntimeError as e:
        flight_recorder.dump(run_dir, f"{type(e).__name__}: {e}")
        return "timed out"
    finally:
        if rank == 1:
            flight_recorder.dump(run_dir, "moved on")
    return "done"


def test_flight_recorder_dump_read_back_by_the_debug_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "100")  # the forked ranks start torch's recorder
    assert multiproc.run(_hang, 2, str(tmp_path), timeout=60) == ["timed out", "done"]
    assert {p.name for p in (tmp_path / "flight_recorder").iterdir()} == {"rank0", "rank1"}
    from minddp.tools import main as minddp_cli

    monkeypatch.setattr("sys.argv", ["minddp"])  # the dispatcher hands the tool its own argv
    with pytest.raises(SystemExit) as usage:  # `minddp debug` without a run dir: usage, exit 2
        minddp_cli(["debug"])
    assert usage.value.code == 2
    minddp_cli(["debug", str(tmp_path)])  # what `minddp debug <run dir>` prints, in-process
    out = capsys.readouterr().out
    assert "ranks [0] are in #4 all_reduce(float32, shape [5]); ranks [1] never called it" in out, out
    assert "rank 1: last #3 all_reduce(float32, shape [3]): never called #4, which ranks [0] are waiting in" \
        in out, out
    assert "rank 0: dumped at step 7 (test): RuntimeError" in out
    # what torch's dump lacks on gloo and minddp's context adds: the group's members
    ctx = json.loads((tmp_path / "flight_recorder_context" / "rank0.json").read_text())
    assert [0, 1] in ctx["groups"].values()
    # a rank whose only dump is nccl's watchdog's (killed before minddp dumped) is still read
    (tmp_path / "flight_recorder" / "rank1").rename(tmp_path / "flight_recorder" / "watchdog_rank1")
    minddp_cli(["debug", str(tmp_path)])
    assert "ranks [1] never called it" in capsys.readouterr().out


def test_a_rank_that_reaches_the_collective_after_the_timeout_never_called_it(tmp_path, monkeypatch, capsys):
    """The stuck rank's stall ends before a launcher's SIGTERM reaches it: its dump shows it in
    the collective too, but it entered 4 s after rank 0, past rank 0's 2 s timeout (the race
    of test_stuck_rank_ends_every_rank_and_the_dumps_name_the_collective under load)."""
    from minddp.tools import debug

    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "100")
    assert multiproc.run(_hang, 2, str(tmp_path), 4.0, timeout=60) == ["timed out", "timed out"]
    debug.main([str(tmp_path)])
    out = capsys.readouterr().out
    assert "ranks [0] are in #4 all_reduce(float32, shape [5]); ranks [1] never called it in time" in out, out
    line = next(x for x in out.splitlines() if x.startswith("  rank 1: reached #4"))
    late = float(line.split(" s after rank 0")[0].rsplit(" ", 1)[1])
    assert 4.0 <= late < 30 and line.endswith("past its 2 s timeout: stuck before it"), line


# ---------------------------------------------------------------- consistency
def _diverge(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    consistency.check_replicas(model)  # identical: passes
    if rank == 1:
        with torch.no_grad():
            model[1].bias[0] += 1e-6
    consistency.check_replicas(model)


def test_replica_divergence_names_the_parameter_on_every_rank():
    errors = multiproc.run_expect_errors(_diverge, 2, timeout=60)
    for text in errors.values():
        assert "parameter '1.bias' differs between rank 0 and rank(s) [1]" in text


# ------------------------------------------------------------ checkpoints
class _RunsCode:
    def __reduce__(self):
        import os

        return (os.system, (f"touch {_RunsCode.marker}",))


def test_checkpoint_whose_pickle_runs_code_is_refused(tmp_path):
    _RunsCode.marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    torch.save({"model": {}, "optimizer": {}, "scheduler": {}, "step": 1, "payload": _RunsCode()}, evil)
    assert not _RunsCode.marker.exists()
    with pytest.raises(checkpoint.CheckpointError, match="refused.*could run code"):
        checkpoint.load(evil, "cpu")
    assert not _RunsCode.marker.exists()  # and nothing ran


def test_incomplete_torchrun_environment_is_named():
    with pytest.raises(ConfigError, match="LOCAL_RANK, WORLD_SIZE not set"):
        env_ranks({"RANK": "0"})
    assert env_ranks({}) == (0, 0, 1)
    assert env_ranks({"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4",
                      "SLURM_STEP_ID": "0"}) == (3, 1, 4)


# ------------------------------------------------------- end to end (slow)
ARGS = [*SMALL, "train.max_steps=6", "train.ckpt_every=2"]


@pytest.mark.slow
def test_truncated_checkpoint_is_named_and_the_previous_one_used(tmp_path):
    run_train(tmp_path / "run", *ARGS, "train.stop_at_step=4")
    first = metrics(tmp_path / "run")  # steps 1-4: the reference for steps 3 and 4 done again
    ckpt = tmp_path / "run" / "checkpoints" / "ckpt_00000004.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:1000])  # truncated on disk
    p = run_train(tmp_path / "run", *ARGS, "train.resume=auto")
    assert f"checkpoint {ckpt} is unreadable" in p.stdout + p.stderr
    assert "resumed from" in p.stdout + p.stderr and "ckpt_00000002.pt" in p.stdout + p.stderr
    again = metrics(tmp_path / "run")
    assert [r["step"] for r in again] == [1, 2, 3, 4, 5, 6]
    assert_same_curves(again[:4], first, atol=1e-6)  # from step 2's checkpoint, the same steps 3 and 4
    # an explicit path to a broken checkpoint is refused, clearly, with exit code 2
    ckpt.write_bytes(b"garbage")
    p = run_train(tmp_path / "x", *ARGS, f"train.resume={ckpt}", check=False)
    assert p.returncode == 2 and "unreadable (truncated or corrupt)" in p.stderr


@pytest.mark.slow
def test_checkpoint_of_another_model_is_refused(tmp_path):
    run_train(tmp_path / "run", *ARGS, "train.max_steps=2")
    p = run_train(tmp_path / "run", *ARGS, "train.resume=auto", "model.n_embd=32", check=False)
    assert p.returncode == 2 and "model.n_embd: 64 -> 32" in p.stderr  # the config check, first
    p = run_train(tmp_path / "run", *ARGS, "train.resume=auto", "model.n_embd=32", "train.resume_force=true",
                  check=False)
    assert p.returncode == 2 and "was written by a different model" in p.stderr


@pytest.mark.slow
def test_missing_data_path_and_partial_env_fail_fast(tmp_path):
    p = run_train(tmp_path / "x", "data=text", "data.path=/no/such/dir", "wandb.mode=disabled", check=False)
    assert p.returncode == 2 and "data.path='/no/such/dir' does not exist" in p.stderr
    p = run_train(tmp_path / "y", *ARGS, check=False, env={"RANK": "0"})
    assert p.returncode == 2 and "LOCAL_RANK, WORLD_SIZE not set" in p.stderr


@pytest.mark.slow
def test_nan_on_one_rank_makes_every_rank_skip_together(tmp_path):
    run_train(tmp_path / "run", *ARGS, "train.fault_nan_step=3", "train.fault_nan_rank=1",
              "train.check_every=1", nproc=2)
    rows = metrics(tmp_path / "run")
    assert rows[2]["loss"] is None and rows[2]["skipped_steps"] == 1  # NaN, logged as null
    assert all(r["loss"] is not None for r in rows[3:])  # replicas stayed equal: checked every step
    p = run_train(tmp_path / "stop", *ARGS, "train.fault_nan_step=3", "train.on_nonfinite=stop",
                  nproc=2, check=False)
    assert p.returncodes == [1, 1], p.stderr[-3000:]  # every rank stops, with the error
    for rank in (0, 1):
        assert f"[rank {rank}] minddp: FloatingPointError: non-finite loss or gradient at step 3" in p.stderr
    assert checkpoint.load(checkpoint.latest(tmp_path / "stop"), "cpu")["step"] == 2


@pytest.mark.slow
def test_debug_fingerprints_on_a_real_run(tmp_path):
    run_train(tmp_path / "on", *ARGS, "ddp.debug=true", nproc=2)
    run_train(tmp_path / "off", *ARGS, nproc=2)
    assert_same_curves(metrics(tmp_path / "on"), metrics(tmp_path / "off"), atol=0)
    a, b = final_model(tmp_path / "on"), final_model(tmp_path / "off")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_killed_rank_fails_the_job_fast_naming_it_and_leaves_a_loadable_checkpoint(tmp_path):
    import os
    import signal
    import time

    from tests.conftest import BIN, LONG, ROOT, env_for, wait_for_step
    from tests.multiproc import free_port

    run_dir = tmp_path / "run"
    cmd = [str(BIN / "torchrun"), "--nproc_per_node=2", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=127.0.0.1:{free_port()}", str(ROOT / "train.py"), *LONG, "train.ckpt_every=1"]
    agent = subprocess.Popen(cmd, cwd=ROOT, env=env_for(run_dir), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_step(run_dir, 6, 120)
        workers = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True,
                                 text=True).stdout.split()
        t0 = time.monotonic()
        os.kill(int(workers[1]), signal.SIGKILL)  # mid-step, maybe mid-checkpoint
        out, _ = agent.communicate(timeout=120)
        elapsed = time.monotonic() - t0
    finally:
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode != 0 and elapsed < 60, (elapsed, out[-3000:])
    assert "local_rank: 1" in out and "exitcode: -9" in out  # the dead rank, named
    state = checkpoint.load(checkpoint.latest(run_dir), "cpu")  # the newest checkpoint is whole
    assert state["step"] >= 5
