"""Launch paths on real software: two torchrun agents (loopback and two network
namespaces), a real two-node Slurm running the project's own sbatch scripts,
elastic restart after a killed worker, and SIGTERM (preemption) then resume."""


import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from tests.conftest import LONG, SMALL, assert_same_curves, final_model, metrics
from tests.launch import BIN, ROOT, env_for, free_port, run_train, train_until_sigterm, wait_for_step

pytestmark = pytest.mark.slow


ARGS = [*SMALL, "train.max_steps=4"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """`python train.py`: the losses every launch below must reproduce."""
    d = tmp_path_factory.mktemp("ref")
    run_train(d, *ARGS)
    return metrics(d)


def _wait_all(procs, timeout):
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1, deadline - time.monotonic()))
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


def test_two_agents_on_loopback_match_single_process(tmp_path, reference):
    port, rdzv = free_port(), uuid.uuid4().hex[:8]
    procs = [subprocess.Popen(
        [str(BIN / "torchrun"), "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
         f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id={rdzv}", str(ROOT / "train.py"), *ARGS],
        cwd=ROOT, env=env_for(tmp_path / "run"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)]
    outs = _wait_all(procs, 180)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert_same_curves(metrics(tmp_path / "run"), reference)
    run_train(tmp_path / "standalone", *ARGS, nproc=2)
    assert_same_curves(metrics(tmp_path / "standalone"), reference)


def _can_make_netns() -> str | None:
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if not shutil.which("ip"):
        return "iproute2 (ip) is not installed"
    probe = f"mddpprobe{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return "this sandbox does not allow `ip netns add`"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@pytest.fixture(scope="module")
def long_reference(tmp_path_factory):
    """The uninterrupted 2-rank run that every interrupted one (Slurm's time limit, a killed
    worker, SIGTERM) must end equal to: trained once for the module."""
    d = tmp_path_factory.mktemp("long_ref")
    run_train(d, *LONG, nproc=2)
    return d


@pytest.fixture
def two_hosts():
    reason = _can_make_netns()
    if reason:
        pytest.skip(reason)
    tag = f"{os.getpid() % 10000}"
    ns, veth = [f"mddp{tag}a", f"mddp{tag}b"], [f"mv{tag}a", f"mv{tag}b"]
    addrs = ["10.123.7.1", "10.123.7.2"]
    cmds = [["ip", "netns", "add", ns[0]], ["ip", "netns", "add", ns[1]],
            ["ip", "link", "add", veth[0], "type", "veth", "peer", "name", veth[1]]]
    for i in range(2):
        cmds += [["ip", "link", "set", veth[i], "netns", ns[i]],
                 ["ip", "-n", ns[i], "addr", "add", f"{addrs[i]}/24", "dev", veth[i]],
                 ["ip", "-n", ns[i], "link", "set", "lo", "up"],
                 ["ip", "-n", ns[i], "link", "set", veth[i], "up"]]
    try:
        for c in cmds:
            subprocess.run(c, check=True, capture_output=True)
        yield ns, veth, addrs
    finally:
        for n in ns:  # the veth pair goes with its namespaces
            subprocess.run(["ip", "netns", "del", n], capture_output=True)


def test_two_hosts_across_a_veth_pair_match_single_process(tmp_path, reference, two_hosts):
    ns, veth, addrs = two_hosts
    port, rdzv = 29614, uuid.uuid4().hex[:8]  # a fresh namespace has every port free
    procs = []
    for i in range(2):
        cmd = ["ip", "netns", "exec", ns[i], str(BIN / "torchrun"), "--nnodes=2", "--nproc_per_node=1",
               "--rdzv_backend=c10d", f"--rdzv_endpoint={addrs[0]}:{port}", f"--rdzv_id={rdzv}",
               # the head must know it hosts the store (its hostname resolves to 127.0.0.1),
               # and each agent must advertise its own address, not localhost
               f"--rdzv_conf=timeout=60,is_host={int(i == 0)}", f"--local_addr={addrs[i]}",
               str(ROOT / "train.py"), *ARGS]
        env = env_for(tmp_path / "run", GLOO_SOCKET_IFNAME=veth[i])
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = _wait_all(procs, 180)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert_same_curves(metrics(tmp_path / "run"), reference)


# ------------------------------------------------------------------ Slurm
CLUSTER = ROOT / "tests" / "slurm" / "cluster.sh"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    state = tmp_path_factory.mktemp("slurm")
    env = {**os.environ, "MINDDP_SLURM_STATE": str(state)}
    if not shutil.which("slurmctld"):
        if os.environ.get("MINDDP_SLURM_INSTALL") != "1":
            pytest.skip("Slurm is not installed: run `tests/slurm/cluster.sh install` as root, "
                        "or set MINDDP_SLURM_INSTALL=1 (as .ci/run does)")
        if os.geteuid() != 0:
            pytest.skip("installing Slurm needs root")
        subprocess.run([str(CLUSTER), "install"], check=True, env=env, timeout=600)
    if subprocess.run(["pgrep", "-x", "slurmctld"], capture_output=True).returncode == 0:
        pytest.skip("a slurmctld is already running here; not starting a test cluster beside it")
    if os.geteuid() != 0:
        pytest.skip("starting slurmd needs root")
    subprocess.run([str(CLUSTER), "start"], check=True, env=env, timeout=120)
    try:
        yield {"SLURM_CONF": str(state / "slurm.conf")}
    finally:
        subprocess.run([str(CLUSTER), "stop"], env=env, timeout=60)


def sbatch(slurm_env, script, *overrides, sbatch_args=(), env=None, wait=True, timeout=240):
    env = {**os.environ, **slurm_env, "MINDDP_PYTHON": sys.executable, "WANDB_MODE": "disabled",
           **(env or {})}
    out = subprocess.run(["sbatch", "--parsable", *sbatch_args, str(ROOT / "slurm" / script),
                          *overrides], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    jid = out.stdout.strip().split(";")[0]
    if wait:
        wait_job(slurm_env, jid, timeout)
    return jid


def job_state(slurm_env, jid):
    env = {**os.environ, **slurm_env}
    out = subprocess.run(["scontrol", "show", "job", jid], env=env, capture_output=True, text=True).stdout
    fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
    return fields.get("JobState"), fields.get("ExitCode"), fields.get("Restarts", "0")


def wait_job(slurm_env, jid, timeout):
    env = {**os.environ, **slurm_env}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:  # poll; `sbatch --wait` backs off far too slowly
        if not subprocess.run(["squeue", "-h", "-j", jid], env=env, capture_output=True,
                              text=True).stdout.strip():
            return
        time.sleep(0.5)
    subprocess.run(["scancel", jid], env=env)
    raise AssertionError(f"job {jid} still running after {timeout}s")


def _job_log(tmp_path):
    return "\n".join(p.read_text() for p in tmp_path.glob("*.out"))


def test_slurm_single_node_two_processes(tmp_path, slurm, reference):
    jid = sbatch(slurm, "single_node.sbatch", *ARGS,
                 sbatch_args=["--cpus-per-task=2", f"--output={tmp_path}/%x-%j.out"],
                 env={"NPROC_PER_NODE": "2", "MINDDP_RUN_DIR": str(tmp_path / "run")})
    assert job_state(slurm, jid)[:2] == ("COMPLETED", "0:0"), _job_log(tmp_path)
    assert_same_curves(metrics(tmp_path / "run"), reference)


def test_slurm_two_nodes_one_process_each(tmp_path, slurm, reference):
    jid = sbatch(slurm, "multinode.sbatch", *ARGS,
                 sbatch_args=["--nodes=2", "--cpus-per-task=1", f"--output={tmp_path}/%x-%j.out"],
                 env={"MINDDP_RUN_DIR": str(tmp_path / "run")})
    assert job_state(slurm, jid)[:2] == ("COMPLETED", "0:0"), _job_log(tmp_path)
    log = _job_log(tmp_path)
    assert "2 nodes x 1" in log and "world 2" in log
    assert_same_curves(metrics(tmp_path / "run"), reference)


def _remove_sweep(sweep):
    """A sweep run where the script puts it by default (the checkout's outputs/), removed with the
    outputs/ it made, when that held nothing else."""
    shutil.rmtree(sweep, ignore_errors=True)
    try:
        sweep.parent.rmdir()
    except OSError:  # the user's own runs are there
        pass


def test_slurm_sweep_array_one_task_per_value(tmp_path, slurm):
    jid = sbatch(slurm, "sweep.sbatch", *ARGS,
                 sbatch_args=["--array=0-1", "--cpus-per-task=1", f"--output={tmp_path}/%x-%A_%a.out"],
                 env={"SWEEP_KEY": "ddp.bucket_cap_mb", "SWEEP_VALUES": "0.01 25",
                      "NPROC_PER_NODE": "1", "MINDDP_RUN_DIR": ""}, wait=False)
    wait_job(slurm, jid, 240)
    runs = sorted((ROOT / "outputs" / f"sweep-{jid}").iterdir())
    try:
        names = [r.name for r in runs]
        assert names == ["ddp.bucket_cap_mb=0.01", "ddp.bucket_cap_mb=25"], _job_log(tmp_path)
        collectives = [metrics(r)[-1]["comm/collectives"] for r in runs]
        assert collectives[0] > collectives[1] == 1  # a smaller cap, more buckets
        assert metrics(runs[0])[-1]["loss"] == pytest.approx(metrics(runs[1])[-1]["loss"], abs=2e-5)
    finally:
        _remove_sweep(ROOT / "outputs" / f"sweep-{jid}")


def test_slurm_sweep_over_layouts_world_1_2_4_across_two_nodes_in_one_wandb_group(tmp_path, slurm, reference):
    """slurm/sweep.sbatch over nodes x processes per node (c10d rendezvous across n1 and n2):
    each run records its layout, trains the reference curve, and logs into the array's group."""
    import json

    from tests.wandb_offline import runs_under

    jid = sbatch(slurm, "sweep.sbatch", *ARGS, "wandb.mode=offline",
                 sbatch_args=["--nodes=2", "--array=0-2", "--cpus-per-task=1",
                              f"--output={tmp_path}/%x-%A_%a.out"],
                 env={"SWEEP_KEY": "layout", "SWEEP_VALUES": "1x1 2x1 2x2", "MINDDP_RUN_DIR": "",
                      "WANDB_MODE": "offline", "WANDB_SILENT": "true"}, wait=False)
    wait_job(slurm, jid, 300)
    sweep = ROOT / "outputs" / f"sweep-{jid}"
    try:
        layouts = {"layout=1x1": (1, 1, 1), "layout=2x1": (2, 2, 1), "layout=2x2": (4, 2, 2)}
        assert sorted(p.name for p in sweep.iterdir()) == sorted(layouts), _job_log(tmp_path)
        for name, layout in layouts.items():
            info = json.loads((sweep / name / "run.json").read_text())
            assert (info["world_size"], info["nodes"], info["nproc_per_node"]) == layout, _job_log(tmp_path)
            assert_same_curves(metrics(sweep / name), reference)
        assert "2 nodes x 2 (n1,n2)" in _job_log(tmp_path)
        runs = runs_under(sweep)
        assert {w["group"] for w in runs} == {f"sweep-{jid}"}  # one W&B group per array
        worlds = sorted((w["config"]["world_size"], w["config"]["nodes"]) for w in runs)
        assert worlds == [(1, 1), (2, 2), (4, 2)]
    finally:
        _remove_sweep(sweep)


def test_slurm_time_limit_signal_checkpoints_requeues_and_resumes(tmp_path, slurm, long_reference):
    ref = long_reference
    run_dir = tmp_path / "run"
    jid = sbatch(slurm, "single_node.sbatch", *LONG,
                 sbatch_args=["--cpus-per-task=2", f"--output={tmp_path}/%x-%j.out"],
                 env={"NPROC_PER_NODE": "2", "MINDDP_RUN_DIR": str(run_dir)}, wait=False)
    wait_for_step(run_dir, 8, 120)
    env = {**os.environ, **slurm}
    # what Slurm sends --signal=B:USR1@90 before the time limit
    subprocess.run(["scancel", "--batch", "--signal=USR1", jid], env=env, check=True)
    wait_job(slurm, jid, 300)  # requeued, held back cred_expire+1 s (see cluster.sh), rerun
    state, code, restarts = job_state(slurm, jid)
    log = _job_log(tmp_path)
    ctld = Path(slurm["SLURM_CONF"]).parent / "log" / "slurmctld.log"
    assert (state, code) == ("COMPLETED", "0:0"), log + "\n--- slurmctld:\n" + ctld.read_text()[-3000:]
    assert int(restarts) >= 1 and "checkpointing and requeueing" in log and "resumed from" in log, log
    assert_same_model(final_model(run_dir), final_model(ref))
    assert_same_curves(metrics(run_dir), metrics(ref), atol=1e-6)


# --------------------------------------------------- elastic and SIGTERM
def assert_same_model(a, b):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def test_elastic_restart_after_a_killed_worker_resumes_to_the_same_result(tmp_path, long_reference):
    ref = long_reference
    run_dir = tmp_path / "run"
    cmd = [str(BIN / "torchrun"), "--nnodes=1:2", "--nproc_per_node=2", "--max-restarts=1",
           "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}",
           f"--rdzv_id={uuid.uuid4().hex[:8]}", "--rdzv_conf=last_call_timeout=1", "--monitor-interval=0.2",
           str(ROOT / "train.py"), *LONG, "train.resume=auto"]
    # torch 2.13's c10d rendezvous shares one TCPStore across restart rounds, so the
    # restarted workers read the dead round's addresses; opting out gives each round its own
    env = env_for(run_dir, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    agent = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_step(run_dir, 12, 120)
        workers = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True,
                                 text=True).stdout.split()
        assert len(workers) == 2, workers
        os.kill(int(workers[1]), signal.SIGKILL)
        out, _ = agent.communicate(timeout=240)
    finally:
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode == 0, out[-4000:]
    assert "resumed from" in out, out[-4000:]  # the restarted group picked up the checkpoint
    assert_same_model(final_model(run_dir), final_model(ref))
    assert_same_curves(metrics(run_dir), metrics(ref), atol=1e-6)


def test_sigterm_checkpoints_and_exits_cleanly_then_resume_matches(tmp_path, long_reference):
    ref = long_reference
    run_dir = tmp_path / "run"
    out = train_until_sigterm(run_dir, *LONG, rows=8)
    assert "stopping after step" in out and "stop signal" in out, out[-4000:]
    stopped = metrics(run_dir)[-1]["step"]
    assert stopped < 120
    ckpts = sorted((run_dir / "checkpoints").glob("ckpt_*"))
    assert ckpts[-1].name == f"ckpt_{stopped:08d}"  # a checkpoint at the very step it stopped
    summary = (run_dir / "summary.json").read_text()  # the steady state, written on the way out
    assert f'"steps": {stopped},' in summary and '"tokens_per_s":' in summary, summary
    run_train(run_dir, *LONG, "train.resume=auto", nproc=2)
    assert_same_model(final_model(run_dir), final_model(ref))
    assert_same_curves(metrics(run_dir), metrics(ref), atol=1e-6)
