"""make soak-faults: the faults that lose runs, on real 2-rank torchrun jobs.

1. disk full: the run dir on a small tmpfs that fills up mid-run (a filler file leaves room for
   one and a half checkpoints, saved every 4 steps): the second save fails with
   CheckpointWriteError naming the folder and its free space, on every rank, the earlier
   checkpoint intact; a torn metrics line is added (what a full disk leaves); space is freed;
   train.resume=auto finishes with the same final parameters, bitwise, as an uninterrupted run.
2. kill -9 during saves: the whole job is killed (SIGKILL, agent and workers) while a checkpoint's
   temporary file is being written, at steps 4, 7 and 10; each restart removes the orphan and resumes;
   the end equals the uninterrupted run, bitwise.
3. all checkpoints unreadable: exit code 2 on every rank, each file named, none of them touched.
4. a corrupt newest checkpoint, of each kind (truncated, random bytes, a nested key missing, a
   tensor of the wrong shape, a flipped bit, a dangling symlink, a folder): the resume names it,
   falls back to the previous one and ends bitwise equal to the uninterrupted run.
5. `checkpoints/` a dangling symlink (an unmounted disk): exit 2 on every rank naming the link,
   metrics.jsonl untouched; the link fixed, the resume is exact.
6. Ctrl-C (SIGINT) to the workers: the step finishes, a checkpoint is saved, exit 130; the
   printed command resumes it to the same end, bitwise.
7. folder checkpoints (train.ckpt_format=dcp, ckpt_async=true: each save written beside the next
   step): kill -9 while a save's temporary folder is being written, at steps 4, 7 and 10, each
   restart removing it; then the newest folder damaged (a flipped bit in a rank's file, no
   integrity.json): named, the previous one used; every end bitwise equal to the uninterrupted run.
8. retention (folders, train.ckpt_keep=2, train.ckpt_keep_every=5): kill -9 while rank 0 deletes an
   old checkpoint (moved out of the listing, not yet removed), at steps 4 and 9: the newest
   checkpoint is the one just saved and whole, nothing half-deleted is listed; the resume removes
   what the kill left, keeps exactly 12, 11, 10 and 5, and ends bitwise equal to the uninterrupted run.

Phases 1-6 are about checkpoint files: they run with train.ckpt_format=file train.ckpt_keep=0
(0.5's defaults); 7 and 8 with folders, today's default.

Needs root for `mount -t tmpfs` (phase 1 is skipped, saying so, where mount is not permitted).
Usage: python scripts/soak_faults.py
         [--phases disk_full,kill9,unreadable,corrupt,dangling,sigint,dcp,retention]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from minddp.train import checkpoint  # noqa: E402
from tests.conftest import BIN, metrics  # noqa: E402
from tests.files import corrupt  # noqa: E402
from tests.launch import env_for, free_port, run_train, wait_for_step  # noqa: E402

# ~1.8M parameters: a checkpoint of ~22 MB, whose write takes long enough to be killed in
ARGS = ["data=synthetic", "model.n_layer=4", "model.n_embd=192", "model.n_head=4", "model.block_size=32",
        "train.global_batch_size=16", "train.micro_batch_size=4", "train.eval_every=0",
        "optim.warmup_steps=2", "wandb.mode=disabled", "train.max_steps=12", "train.ckpt_every=1",
        "train.ckpt_format=file", "train.ckpt_keep=0"]
STEPS = 12
EVERY_4 = ["train.ckpt_every=4"]  # the disk-full run: checkpoints 4, 8, 12 (the end does not depend on it)


def say(msg: str) -> None:
    print(f"soak-faults: {msg}", flush=True)


def final_params(run_dir: Path) -> dict:
    last = checkpoint.latest(run_dir)
    assert last.name.startswith(f"ckpt_{STEPS:08d}"), last
    return checkpoint.load(last, "cpu")["model"]


def assert_same_params(run_dir: Path, ref: dict) -> None:
    got = final_params(run_dir)
    bad = [k for k in ref if not torch.equal(got[k], ref[k])]
    assert not bad, f"{run_dir}: parameters differ from the uninterrupted run: {bad[:5]}"
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, STEPS + 1)), metrics(run_dir)


def digest(paths) -> dict:
    return {p.name: hashlib.sha1(p.read_bytes()).hexdigest() for p in paths}


# ------------------------------------------------------------------ 1. disk full
def mount_tmpfs(where: Path, size_mb: int) -> bool:
    where.mkdir(parents=True)
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(where)],
                       capture_output=True, text=True)
    if p.returncode:
        say(f"disk_full skipped: mount -t tmpfs not permitted here ({p.stderr.strip()})")
    return p.returncode == 0


def disk_full(work: Path, ref: dict, ckpt_bytes: int) -> None:
    mnt = work / "tmpfs"
    if not mount_tmpfs(mnt, size_mb=ckpt_bytes * 4 // 2**20 + 16):  # 3 checkpoints and the rest
        return
    try:
        run = mnt / "run"
        filler = mnt / "filler"
        room = int(1.5 * ckpt_bytes)  # step 4's checkpoint fits, step 8's does not
        filler.write_bytes(b"\0" * (shutil.disk_usage(mnt).free - room))
        t0 = time.monotonic()
        p = run_train(run, *ARGS, *EVERY_4, nproc=2, check=False, timeout=300)
        err = p.stderr
        assert p.returncode != 0, "the run should have failed on the full disk"
        assert "[rank 0] minddp: CheckpointWriteError: could not write checkpoint" in err, err[-3000:]
        assert f"MiB free in {run / 'checkpoints'}" in err, err[-3000:]
        assert "previous checkpoint is intact" in err, err[-3000:]
        assert "[rank 1] minddp: CheckpointWriteError: rank 0 could not save step 8" in err, err[-3000:]
        kept = sorted(p.name for p in (run / "checkpoints").iterdir())
        assert kept == ["ckpt_00000004.pt"], kept  # no partial file left either
        say(f"disk full at step 8's checkpoint: CheckpointWriteError on both ranks, {kept} intact "
            f"({time.monotonic() - t0:.0f} s)")
        with open(run / "metrics.jsonl", "a") as f:
            f.write('{"step": 9, "loss": 2.71')  # a line the full disk tore
        filler.unlink()
        p = run_train(run, *ARGS, *EVERY_4, "train.resume=auto", nproc=2, timeout=300)
        assert "torn by an interrupted write" in p.stdout + p.stderr
        assert_same_params(run, ref)
        say("space freed, resumed: final parameters equal the uninterrupted run's (bitwise); "
            "the torn metrics line was dropped and reported")
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


# ------------------------------------------------------------- 2. kill -9 in saves
def start_job(run_dir: Path, log: Path, *extra) -> subprocess.Popen:
    cmd = [str(BIN / "torchrun"), "--nproc_per_node=2", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=127.0.0.1:{free_port()}", str(ROOT / "train.py"), *ARGS, *extra]
    with open(log, "w") as out:  # a session of its own: killpg reaches the agent and the workers
        return subprocess.Popen(cmd, cwd=ROOT, env=env_for(run_dir), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def temporaries(d: Path) -> set[str]:
    """A file's (`.ckpt_<step>.pt.<random>.tmp`) or a folder's (`.ckpt_<step>.tmp-<id>`)."""
    if not d.is_dir():
        return set()
    return {e.name for e in os.scandir(d) if e.name.endswith(".tmp") or ".tmp-" in e.name}


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun starts each worker in a session of its own)."""
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(stat.parent.name)] = int(fields[1])
    found, todo = [], [pid]
    while todo:
        up = todo.pop()
        kids = [p for p, pp in parent.items() if pp == up]
        found += kids
        todo += kids
    return found


def kill_job(job: subprocess.Popen) -> None:
    """SIGKILL the workers and the agent at once, as a node that loses power would."""
    for pid in [*descendants(job.pid), job.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    job.wait()


def kill_during_a_save(run_dir: Path, job: subprocess.Popen, step: int, timeout: float = 240) -> str | None:
    """Kill the whole job the moment the temporary file of step `step`'s checkpoint exists; its
    name, or None if the job ended first. (Orphans of the previous kill stay until start-up.)"""
    d, deadline = run_dir / "checkpoints", time.monotonic() + timeout
    stale = temporaries(d)
    while time.monotonic() < deadline and job.poll() is None:
        new = {n for n in temporaries(d) - stale if n.startswith(f".ckpt_{step:08d}.")}
        if new:
            kill_job(job)
            return new.pop()
        time.sleep(0.001)
    if job.poll() is None:
        kill_job(job)
        raise AssertionError("no checkpoint write seen")
    return None


def kill9(work: Path, ref: dict, kills: int, *extra, name: str = "kill9") -> Path:
    run = work / name
    for k in range(kills):
        log = work / f"{name}-{k}.log"
        job = start_job(run, log, *extra, *(["train.resume=auto"] if k else []))
        name = kill_during_a_save(run, job, step=3 * k + 4)  # at 4, 7, 10: each restart gets further
        assert name, f"the job ended before a save could be killed: {log.read_text()[-2000:]}"
        time.sleep(1)
        assert (run / "checkpoints" / name).exists()  # the orphan kill -9 left behind, nobody renames it
        say(f"kill -9 #{k + 1} while writing {name}; checkpoints now "
            f"{[p.name for p in checkpoint.all_checkpoints(run)][:2]}")
    p = run_train(run, *ARGS, *extra, "train.resume=auto", nproc=2, timeout=300)
    assert not kills or "a temporary file left by an interrupted write" in p.stdout + p.stderr
    assert not list((run / "checkpoints").glob(".*")), "orphans left"
    assert_same_params(run, ref)
    say(f"{kills} kills during saves, orphans removed at start-up: final parameters equal (bitwise)")
    return run


# ---------------------------------------------------------- 3. all unreadable
def unreadable(run: Path) -> None:
    paths = sorted((run / "checkpoints").glob("ckpt_*.pt"))
    for p in paths:
        p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2])
    before = digest(paths)
    p = run_train(run, *ARGS, "train.resume=auto", nproc=2, check=False, timeout=300)
    assert p.returncodes == [2, 2], (p.returncodes, p.stderr[-3000:])  # forked ranks (tests.launch)
    for rank in (0, 1):
        assert f"[rank {rank}] minddp: configuration error:" in p.stderr, p.stderr[-3000:]
    assert all(str(q) in p.stderr for q in paths), p.stderr[-3000:]
    assert digest(paths) == before and sorted((run / "checkpoints").iterdir()) == paths
    say(f"all {len(paths)} checkpoints unreadable: exit 2 on both ranks, each named, none touched")


# ------------------------------------------- 4-6. corrupt newest, dangling link, SIGINT
CORRUPT = ["truncated:15000", "random:0", "rng", "scheduler.last_epoch", "optimizer.param_groups",
           "wrong shape", "flipped bit", "dangling symlink", "folder"]


def stopped_at(work: Path, name: str, step: int) -> Path:
    """A run stopped after `step`, holding only its last two checkpoints (the soak's disk)."""
    run = work / name
    run_train(run, *ARGS, f"train.stop_at_step={step}", nproc=2, timeout=300)
    for p in checkpoint.all_checkpoints(run)[2:]:
        p.unlink()
    return run


def corrupt_newest(work: Path, ref: dict) -> None:
    base = stopped_at(work, "corrupt-base", 6)
    for kind in CORRUPT:
        run = work / f"corrupt-{kind.split(':')[0].replace('.', '-')}"
        shutil.copytree(base, run, symlinks=True)
        corrupt(run / "checkpoints" / "ckpt_00000006.pt", kind)
        p = run_train(run, *ARGS, "train.resume=auto", nproc=2, timeout=300)
        out = p.stdout + p.stderr
        assert "trying the previous checkpoint" in out and "ckpt_00000005.pt at step 5" in out, out[-3000:]
        assert_same_params(run, ref)
        shutil.rmtree(run)
        say(f"newest checkpoint corrupt ({kind}): named, resumed from step 5, final parameters equal")


def dangling(work: Path, ref: dict) -> None:
    run = stopped_at(work, "dangling", 6)
    (run / "checkpoints").rename(work / "ckpts-moved")
    (run / "checkpoints").symlink_to(work / "unmounted")
    before = (run / "metrics.jsonl").read_bytes()
    p = run_train(run, *ARGS, "train.resume=auto", nproc=2, check=False, timeout=300)
    assert p.returncodes == [2, 2], (p.returncodes, p.stderr[-3000:])  # forked ranks (tests.launch)
    lines = [x for x in p.stderr.splitlines() if "minddp: configuration error:" in x]
    for rank in (0, 1):  # rank 1: "rank 0 could not resume: CheckpointError: <the same>"
        named = f"{run}/checkpoints is a symlink"
        assert any(x.startswith(f"[rank {rank}]") and named in x for x in lines), lines
    assert (run / "metrics.jsonl").read_bytes() == before
    (run / "checkpoints").unlink()
    (work / "ckpts-moved").rename(run / "checkpoints")
    run_train(run, *ARGS, "train.resume=auto", nproc=2, timeout=300)
    assert_same_params(run, ref)
    say("checkpoints/ a dangling link: exit 2 on both ranks naming it, metrics kept; fixed, resumed exact")


def sigint(work: Path, ref: dict) -> None:
    """Ctrl-C reaching the workers (a terminal's SIGINT to the whole job): each finishes the step,
    saves, exits 130; the printed command continues the run."""
    run, log = work / "sigint", work / "sigint.log"
    job = start_job(run, log)
    wait_for_step(run, 4, 240)
    for pid in descendants(job.pid):
        os.kill(pid, signal.SIGINT)
    job.wait(timeout=240)
    out = log.read_text()
    assert "stopping after step" in out and "exitcode  : 130" in out, out[-3000:]
    command = out.split("resume with:\n", 1)[1].splitlines()[0].split()
    assert command[:3] == ["torchrun", "--standalone", "--nproc_per_node=2"], command
    assert command[-1] == f"train.resume={run}", command
    run_train(None, *command[4:], nproc=2, timeout=300)  # the printed overrides, as printed
    assert_same_params(run, ref)
    say("Ctrl-C: step finished, checkpoint saved, exit 130 on both ranks; the printed command resumed "
        "it exactly")


# ------------------------------------------------------- 7. folder checkpoints
DCP = ["train.ckpt_format=dcp", "train.ckpt_async=true"]
FOLDER_DAMAGE = {"a flipped bit in a rank's file": "__1_0.distcp", "no integrity.json": "integrity.json"}


def folders(work: Path, ref: dict) -> None:
    run = kill9(work, ref, 3, *DCP, name="dcp-kill9")
    for what, name in FOLDER_DAMAGE.items():
        damaged = work / f"dcp-{name}"
        shutil.copytree(run, damaged, symlinks=True)
        newest, previous = checkpoint.all_checkpoints(damaged)[:2]
        if name == "integrity.json":
            (newest / name).unlink()
        else:
            corrupt(newest / name, "flipped bit")
        p = run_train(damaged, *ARGS, *DCP, "train.resume=auto", nproc=2, timeout=300)
        out = p.stdout + p.stderr
        assert f"{newest} is corrupt" in out and f"{previous} at step" in out, out[-3000:]
        assert_same_params(damaged, ref)
        say(f"newest folder damaged ({what}): named, resumed from {previous.name}, final parameters equal")


# ------------------------------------------------------- 8. retention
KEEP = ["train.ckpt_format=dcp", "train.ckpt_keep=2", "train.ckpt_keep_every=5"]


def kill_during_a_deletion(run_dir: Path, job: subprocess.Popen, victim: int,
                           timeout: float = 240) -> str | None:
    """Kill the whole job the moment checkpoint `victim` is on its way out (`.ckpt_<step>.trash-<id>`)."""
    d, deadline = run_dir / "checkpoints", time.monotonic() + timeout
    while time.monotonic() < deadline and job.poll() is None:
        trash = [e.name for e in os.scandir(d) if e.name.startswith(f".ckpt_{victim:08d}.trash-")] \
            if d.is_dir() else []
        if trash:
            kill_job(job)
            return trash[0]
        time.sleep(0.005)
    if job.poll() is None:
        kill_job(job)
    return None


def retention(work: Path, ref: dict) -> None:
    run = work / "retention"
    # rank 0 sleeps between moving a checkpoint aside and removing it: after saving 4 it deletes 2,
    # after 9 it deletes 7 (keep 2; 5 and 10 are milestones)
    for k, (step, victim) in enumerate(((4, 2), (9, 7))):
        log = work / f"retention-{k}.log"
        pause = [f"train.fault_sleep_step={step}", "train.fault_sleep_in=checkpoint_delete",
                 "train.fault_sleep_s=60"]
        job = start_job(run, log, *KEEP, *pause, *(["train.resume=auto"] if k else []))
        trash = kill_during_a_deletion(run, job, victim)
        assert trash, f"no deletion was seen: {log.read_text()[-2000:]}"
        names = [p.name for p in checkpoint.all_checkpoints(run)]
        assert names[0] == f"ckpt_{step:08d}" and f"ckpt_{victim:08d}" not in names, names
        assert checkpoint.load(checkpoint.latest(run), "cpu")["step"] == step
        say(f"kill -9 #{k + 1} while deleting ({trash}): listed {names}, the newest whole")
    p = run_train(run, *ARGS, *KEEP, "train.resume=auto", nproc=2, timeout=300)
    assert "whose deletion was interrupted" in p.stdout + p.stderr, (p.stdout + p.stderr)[-3000:]
    names = [p.name for p in checkpoint.all_checkpoints(run)]
    assert names == ["ckpt_00000012", "ckpt_00000011", "ckpt_00000010", "ckpt_00000005"], names
    assert not list((run / "checkpoints").glob(".*")), "leftovers"
    assert_same_params(run, ref)
    say(f"retention: 2 kills during deletions, resumed; kept exactly {names}; final parameters equal "
        "(bitwise)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phases", default="disk_full,kill9,unreadable,corrupt,dangling,sigint,dcp,retention")
    args = ap.parse_args(argv)
    phases = args.phases.split(",")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="soak-faults-") as tmp:
        work = Path(tmp)
        run_train(work / "ref", *ARGS, nproc=2, timeout=300)
        ref = final_params(work / "ref")
        ckpt_bytes = (work / "ref" / "checkpoints" / "ckpt_00000001.pt").stat().st_size
        say(f"uninterrupted reference: {STEPS} steps, checkpoints of {ckpt_bytes / 2**20:.1f} MiB")
        if "disk_full" in phases:
            disk_full(work, ref, ckpt_bytes)
        if "kill9" in phases or "unreadable" in phases:
            run = kill9(work, ref, 3 if "kill9" in phases else 0)
            if "unreadable" in phases:
                unreadable(run)
        for name, phase in (("corrupt", corrupt_newest), ("dangling", dangling), ("sigint", sigint),
                            ("dcp", folders), ("retention", retention)):
            if name in phases:
                phase(work, ref)
    say(f"all passed in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
