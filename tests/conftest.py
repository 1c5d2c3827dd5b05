import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

import json  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.launch import BIN, ROOT  # noqa: E402, F401 - also importable from here

torch.set_num_threads(1)

# ------------------------------------------------ shared by the end-to-end tests
SMALL = ["data=synthetic", "model.n_layer=2", "model.n_embd=64", "model.n_head=4",
         "model.block_size=32", "train.global_batch_size=16", "train.micro_batch_size=4",
         "train.eval_every=3", "train.eval_samples=64", "optim.warmup_steps=2", "wandb.mode=disabled"]
LONG = [*SMALL, "train.max_steps=120", "train.ckpt_every=5", "train.eval_every=0"]
TOK = [a for a in SMALL if not a.startswith("data=")]  # SMALL for runs on token files (data=tokens)


@pytest.fixture(autouse=True)
def _no_subprocess_in_test_fast(request, monkeypatch):
    """`make test-fast` (MINDDP_TEST_FAST=1) is the inner loop: a test that starts a process
    (train.py, torchrun, a tool's CLI, a build) must be marked slow, and this says which."""
    if os.environ.get("MINDDP_TEST_FAST") != "1":
        return

    def refuse(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} starts a subprocess ({args[0] if args else kwargs}): "
                             "mark it @pytest.mark.slow, or call the tool's main() in-process")

    monkeypatch.setattr(subprocess, "Popen", refuse)


# ------------------------------------- the suite writes only to temporary folders, never the checkout
# where a run, a sweep or W&B lands by default: what `minddp report outputs` would list as the user's;
# and build/, which a wheel built in the checkout leaves (its build/lib goes into the next wheel)
DEFAULT_OUTPUTS = ("outputs", "multirun", "wandb", "build")
_BEFORE = pytest.StashKey[set]()
_BLAMED = pytest.StashKey[dict]()


def repo_outputs() -> set[str]:
    """Each default folder that exists (`outputs/`, even empty) and what it holds."""
    found = {f"{d}/" for d in DEFAULT_OUTPUTS if (ROOT / d).is_dir()}
    return found | {f"{d}{name}" for d in found for name in os.listdir(ROOT / d)}


def pytest_sessionstart(session):
    session.config.stash[_BEFORE] = repo_outputs()
    session.config.stash[_BLAMED] = {}


@pytest.fixture(autouse=True)
def _note_what_a_test_leaves_in_the_checkout(request):
    """Which test left it (one process only: under xdist another worker's test may be the one)."""
    before = repo_outputs() if "PYTEST_XDIST_WORKER" not in os.environ else None
    yield
    if before is not None:
        for entry in repo_outputs() - before:
            request.config.stash[_BLAMED].setdefault(entry, request.node.nodeid)


def pytest_sessionfinish(session, exitstatus):
    """A session that leaves a run in outputs/, multirun/ or wandb/ of the checkout fails, naming
    it (and the test, where one process ran them all): tests write under tmp_path."""
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller checks once
        return
    left = sorted(repo_outputs() - session.config.stash.get(_BEFORE, set()))
    if not left:
        return
    blamed = session.config.stash.get(_BLAMED, {})
    lines = [f"  {ROOT / e}" + (f"  (left by {blamed[e]})" if e in blamed else "") for e in left]
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter:
        reporter.write("\n")  # after the progress line
        reporter.write_line("minddp: the tests left these in the checkout (tests write under tmp_path):",
                            red=True)
        for line in lines:
            reporter.write_line(line)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def corpus(tmp_path):
    """A small text file to prepare."""
    from tests.files import corpus

    return corpus(tmp_path / "corpus.txt")


@pytest.fixture
def drawn_figures(monkeypatch):
    """Every matplotlib figure saved during the test, to check a plot against its data."""
    from matplotlib.figure import Figure

    figures, save = [], Figure.savefig

    def record(fig, *args, **kwargs):
        figures.append(fig)
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    return figures


def compose_config(*overrides):
    """conf/'s config with these Hydra overrides, as train.py composes it."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def main_exit(main, capsys, *argv):
    """A tool's main(argv) in this process: (exit code, stderr)."""
    try:
        main([str(a) for a in argv])
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def as_nobody(cmd):
    """`cmd` run as an unprivileged user when the tests run as root (root writes anywhere): the
    way to test a folder that cannot be written. The checkout must be readable by that user, as
    a clone under a 0755 folder is; a 0700 parent (mktemp -d) fails here, naming the fix."""
    if os.geteuid() != 0:
        return cmd
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    probe = subprocess.run([*nobody, "cat", str(ROOT / "train.py")], capture_output=True, text=True)
    assert probe.returncode == 0, (f"user nobody cannot read {ROOT} ({probe.stderr.strip()}): clone the "
                                   "project under a folder others can read (chmod 755 its parents)")
    return [*nobody, *cmd]


def metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def final_model(run_dir):
    """The newest checkpoint's weights, a file (ckpt_<step>.pt) or a folder (train.ckpt_format=dcp)."""
    from minddp.train.checkpoint import latest, load

    return load(latest(run_dir), "cpu")["model"]


def assert_same_curves(a, b, atol=2e-5):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert ra["loss"] == pytest.approx(rb["loss"], abs=atol), (ra["step"], ra["loss"], rb["loss"])
        assert ("val_loss" in ra) == ("val_loss" in rb)
        if "val_loss" in ra:
            assert ra["val_loss"] == pytest.approx(rb["val_loss"], abs=atol)


@pytest.fixture
def in_process_trainer(monkeypatch, tmp_path):
    """`make(*overrides, run_dir=None)` builds minddp's Trainer in this process (world 1, gloo):
    for the tests where a subprocess adds nothing but seconds. What the trainer changes
    process-wide is put back after the test: its stop handlers, the process group, hooks and
    tracker; torch's flight recorder stays off (it aborts the interpreter at exit)."""
    import signal

    import torch.distributed as dist

    from minddp.train.config import register
    from minddp.train.trainer import Trainer

    register()
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(key, raising=False)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    made = []

    def make(*overrides, run_dir=None) -> Trainer:
        cfg = compose_config("wandb.mode=disabled", "train.flight_recorder=0", *overrides)
        made.append(Trainer(cfg, str(run_dir or tmp_path / "run")))
        return made[-1]

    yield make
    for t in made:
        if hasattr(t, "tracker"):
            t.tracker.close()
        if hasattr(t, "ddp"):
            t.ddp.remove_hooks()
    if dist.is_initialized():
        dist.destroy_process_group()
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
