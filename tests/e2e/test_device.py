"""Device and backend selection, checked on CPU with CUDA availability mocked."""


import io
import re
import tokenize
from pathlib import Path

import pytest
import torch

from minddp.parallel.dist import backend_for, pick_device, select_device
from minddp.tools import cli
from tests.launch import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_cuda_when_available_follows_local_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    dev = pick_device(local_rank=3)
    assert dev == torch.device("cuda", 3) and backend_for(dev) == "nccl"
    with pytest.raises(RuntimeError, match="LOCAL_RANK=4 but only 4 GPU"):
        pick_device(local_rank=4)
    assert pick_device(0, "cpu") == torch.device("cpu")


def test_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    dev = pick_device(local_rank=1)
    assert dev == torch.device("cpu") and backend_for(dev) == "gloo"
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        pick_device(0, "cuda")


def test_select_device_from_the_visible_count():
    """No torch patching: the visible device count is a parameter."""
    assert select_device(3, "auto", True, 4) == torch.device("cuda", 3)
    assert select_device(0, "auto", True, 8) == torch.device("cuda", 0)
    # srun --gpus-per-task=1: each task sees one device, its LOCAL_RANK (SLURM_LOCALID) can be 1..7
    for local in range(8):
        assert select_device(local, "auto", True, 1) == torch.device("cuda", 0)
        assert select_device(local, "cuda", True, 1) == torch.device("cuda", 0)
    with pytest.raises(RuntimeError, match="LOCAL_RANK=2 but only 2 GPU"):
        select_device(2, "auto", True, 2)
    assert select_device(5, "auto", False, 0) == torch.device("cpu")
    assert select_device(1, "cpu", True, 4) == torch.device("cpu")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        select_device(0, "cuda", False, 0)


def test_more_nccl_ranks_than_gpus_is_one_configuration_error():
    from minddp.errors import ConfigError
    from minddp.parallel.dist import check_ranks_per_gpu, local_world_size

    with pytest.raises(ConfigError, match=r"2 ranks on this node but 1 GPU\(s\) visible.*--nproc_per_node=1"):
        check_ranks_per_gpu(2, 1, "nccl")
    with pytest.raises(ConfigError, match=r"9 ranks on this node but 8 GPU.*--nproc_per_node=8"):
        check_ranks_per_gpu(9, 8, "nccl")
    for lws, count, backend in [(1, 1, "nccl"), (8, 8, "nccl"), (2, 1, "gloo"), (4, 0, "gloo")]:
        check_ranks_per_gpu(lws, count, backend)  # one GPU each, or gloo (may share a GPU)
    assert local_world_size({"LOCAL_WORLD_SIZE": "4"}) == 4
    assert local_world_size({"SLURM_NTASKS": "8", "SLURM_PROCID": "3"}) == 1  # srun: a GPU per task


def test_init_distributed_refuses_two_nccl_ranks_on_one_gpu_before_any_process_group(monkeypatch):
    """What `make train NPROC=2` on a one-GPU machine meets on every rank (each rank's env alike)."""
    from minddp.errors import ConfigError
    from minddp.parallel.dist import init_distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for rank in ("0", "1"):
        env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        with pytest.raises(ConfigError, match="1 GPU"):
            init_distributed()
        with pytest.raises(ConfigError, match="1 GPU"):
            init_distributed("cuda")
    assert not torch.distributed.is_initialized()


def test_timing_strategy_matches_the_backend():
    assert cli.timing_strategy(torch.device("cuda", 0)) == "cuda-sync"
    assert cli.timing_strategy(torch.device("cpu")) == "host-clock"
    assert cli.BACKEND_DEVICE == {"auto": "auto", "gloo": "cpu", "nccl": "cuda"}


TOOLS = [*sorted((ROOT / "minddp" / "demos").glob("*.py")),
         *[ROOT / "minddp" / "tools" / f"{m}.py" for m in ("bench", "bench_ddp", "bench_trainer",
                                                            "bench_debug", "timeline", "scaling")],
         ROOT / "minddp" / "train" / "trainer.py"]


HARD = re.compile(r"""device\s*=\s*["']cpu["']|torch\.device\(\s*["']cpu["']|"""
                  r"""backend\s*=\s*["']gloo["']|start\(["']gloo""")


def unexplained_hard_codes(src: str) -> list[str]:
    """Lines whose code (comments removed, by the tokenizer) hard-codes the CPU or gloo and
    whose comment gives no reason (a `#` inside a string or a bare `# noqa` is not one)."""
    code = src.splitlines()
    reasons = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            code[row - 1] = code[row - 1][:col]
            text = re.sub(r"noqa(:\s*[\w,\s]+)?|type:\s*ignore\S*", "", tok.string.lstrip("# "))
            reasons[row] = len(text.split()) >= 2
    return [line.strip() for i, line in enumerate(code, 1) if HARD.search(line) and not reasons.get(i)]


def test_the_hard_code_check_reads_comments_not_hashes():
    assert unexplained_hard_codes('device = "cpu"  # the benchmark compares CPU copies\n') == []
    assert unexplained_hard_codes('device = "cpu"; color = "#999"\n') == ['device = "cpu"; color = "#999"']
    assert unexplained_hard_codes('x = torch.device("cpu")  # noqa: E501\n') == ['x = torch.device("cpu")']
    assert unexplained_hard_codes('# device = "cpu" was wrong here\nstart()\n') == []  # only a comment
    assert unexplained_hard_codes('start("gloo")\n') == ['start("gloo")']


@pytest.mark.parametrize("path", TOOLS, ids=lambda p: p.name)
def test_no_tool_hard_codes_the_backend_or_the_cpu(path):
    """Every demo and tool starts through init_distributed (device from LOCAL_RANK, backend
    from the device) and allocates on that device; CPU-only lines carry a reason."""
    src = path.read_text()
    assert "init_process_group(" not in src, f"{path.name}: start through cli.start / init_distributed"
    assert not unexplained_hard_codes(src), f"{path.name}: hard-coded backend or device without a reason"


@pytest.mark.slow
def test_gpu_check_without_cuda_fails_in_one_line_saying_nothing_was_checked():
    import subprocess
    import sys

    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py")], capture_output=True,
                       text=True, timeout=120, env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"})
    assert p.returncode == 1, p.stderr  # a CPU wheel on a GPU node must not read green
    lines = p.stdout.splitlines()
    assert len(lines) == 1 and "nothing was checked" in lines[0], lines
    assert "CPU-only build" in lines[0]  # the reason here: torch==2.13.0 is the CPU wheel


def test_gpu_check_worker_lists_every_check_in_every_mode_and_skips_where_it_proves_nothing():
    import importlib.util
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))  # the worker imports gpu_check, its folder's
    path = ROOT / "scripts" / "gpu_check_worker.py"
    spec = importlib.util.spec_from_file_location("gpu_check_worker", path)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    names = lambda mode, world: [n for n, _ in worker.checks(mode, None, world)]  # noqa: E731
    assert names("nccl", 1) == names("nccl", 8) == names("gloo-cuda", 2) == worker.NAMES
    skipped = lambda mode, world: {n for n, c in worker.checks(mode, None, world)  # noqa: E731
                                   if n in worker.NAMES and worker.skip_reason(n, mode, world)}
    assert skipped("nccl", 8) == set()
    one_gpu = skipped("nccl", 1)
    assert {"equivalence ddp", "join", "find_unused_parameters", "overlap", "comm stats"} <= one_gpu
    assert not any(n.startswith("no host sync") for n in skipped("nccl", 1))
    assert {n for n in worker.NAMES if n.startswith("no host sync")} <= skipped("gloo-cuda", 2)  # via host
    one = dict(worker.checks("nccl", None, 1))
    assert one["join"]()[0] is None and "no-op" in one["join"]()[1]  # a SKIP with its reason, not a PASS


@pytest.mark.slow
@pytest.mark.parametrize("ending,destroyed", [("", True), ("raise RuntimeError('boom')\n", False)])
def test_a_script_that_never_destroys_its_process_group_has_it_destroyed_before_teardown(
        tmp_path, ending, destroyed):
    """Freed during the interpreter's teardown, gloo's last work aborts the process (torch's own
    DDP script too); init_distributed destroys the group at exit, before that teardown, unless an
    uncaught exception ended the script (peers may be in a collective destroying would wait on)."""
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text(
        "import atexit, torch, torch.distributed as dist\n"
        "from minddp.parallel.dist import init_distributed\n"
        "atexit.register(lambda: print('initialized at exit:', dist.is_initialized()))  # runs last\n"
        "init_distributed()\n"
        "t = torch.ones(3); dist.all_reduce(t)\n" + ending)
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "WORLD_SIZE": "1", "RANK": "0",
           "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == (0 if destroyed else 1), p.stderr[-2000:]
    assert f"initialized at exit: {not destroyed}" in p.stdout, p.stdout + p.stderr
