"""make gpu-check's verdicts, on CPU: each fed numbers that must pass and numbers that must fail
(serialised against overlapped collectives, a missing or wrong-step checkpoint, a low MFU, ...),
which items a world of one reports as SKIP, and the torch range minddp supports."""


import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest

import minddp
from minddp import _compat
from tests.conftest import ROOT


def _script(name):
    sys.path.insert(0, str(ROOT / "scripts"))  # the worker imports gpu_check as its own folder's
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gc = _script("gpu_check")


# a backward of 10 ms with 4 bucket all-reduces of 1 ms each (microseconds, as the profiler gives)
BACKWARD = [(i * 1000, i * 1000 + 900) for i in range(10)]  # kernels with gaps


OVERLAPPED = [(2000, 3000), (4500, 5500), (7000, 8000), (10000, 11000)]  # the last after backward


SERIALISED = [(10000 + i * 1000, 11000 + i * 1000) for i in range(4)]  # all after backward


def test_concurrent_fraction_is_the_share_of_collective_time_beside_compute():
    assert gc.concurrent_fraction(SERIALISED, BACKWARD) == 0.0
    assert gc.concurrent_fraction(OVERLAPPED, BACKWARD) == pytest.approx((900 + 400 + 500 + 900) / 4000)
    assert gc.concurrent_fraction([], BACKWARD) == 0.0
    assert gc.concurrent_fraction([(0, 10)], [(0, 5), (2, 8)]) == pytest.approx(0.8)  # compute union


def test_overlap_verdict_flips_when_communication_is_serialised():
    over = gc.concurrent_fraction(OVERLAPPED, BACKWARD)
    serial = gc.concurrent_fraction(SERIALISED, BACKWARD)
    assert gc.overlap_verdict(8, over, serial, 4)[0] is True
    assert gc.overlap_verdict(8, serial, serial, 4)[0] is False  # overlap=True but serialised
    assert gc.overlap_verdict(8, over, over, 4)[0] is False  # the control overlaps: broken measurement
    assert gc.overlap_verdict(8, over, serial, 0)[0] is False  # no collective kernel at all
    ok, reason = gc.overlap_verdict(1, 0.0, 0.0, 0)
    assert ok is None and "needs 2 GPUs" in reason


def test_comm_stats_verdict_is_two_sided():
    assert gc.comm_stats_verdict(2, 4.1e-3, 4e-3, 4)[0] is True
    assert gc.comm_stats_verdict(2, 1e-3, 4e-3, 4)[0] is False  # events see a quarter: wrong events
    assert gc.comm_stats_verdict(2, 20e-3, 4e-3, 4)[0] is False  # events span far more than the kernels
    assert gc.comm_stats_verdict(2, 1e-3, 0.0, 4)[0] is False
    assert gc.comm_stats_verdict(1, 0.0, 0.0, 1)[0] is None


def test_stats_sane_verdict_fails_negative_or_empty_timings():
    assert gc.stats_sane_verdict(2e-3, 3e-3, 1e-3)[0] is True
    assert gc.stats_sane_verdict(-1e-3, 3e-3, 1e-3)[0] is False  # an end event that waited on nothing
    assert gc.stats_sane_verdict(0.0, 0.0, 0.0)[0] is False
    assert gc.stats_sane_verdict(5e-3, 3e-3, 0.0)[0] is False  # busy longer than the span
    assert gc.stats_sane_verdict(float("nan"), 3e-3, 0.0)[0] is False


def test_mfu_verdict_has_a_floor_and_says_it():
    assert gc.mfu_verdict(0.35) == (True, "MFU 35.0% (floor 10%)")
    assert gc.mfu_verdict(0.05)[0] is False
    assert gc.mfu_verdict(None)[0] is False
    assert gc.mfu_verdict(1.5)[0] is False


def test_sigterm_verdict_needs_exit_zero_and_a_loadable_checkpoint_at_the_stop():
    assert gc.sigterm_verdict(0, [7], 7, 7, 5)[0] is True
    assert gc.sigterm_verdict(1, [7], 7, 7, 5)[0] is False  # the exit code counts
    assert gc.sigterm_verdict(0, [], None, 7, 5)[0] is False  # no checkpoint
    assert gc.sigterm_verdict(0, [7], None, 7, 5)[0] is False  # it does not load
    assert gc.sigterm_verdict(0, [6], 6, 7, 5)[0] is False  # not at the step it stopped
    assert gc.sigterm_verdict(0, [3], 3, 3, 5)[0] is False  # from before the signal
    assert "killed" in gc.sigterm_verdict("killed after waiting", [], None, None, 5)[1]


def _rounds(ckpt, after, normal=1.0, n=3):
    return {"ckpt": [ckpt] * n, "after": [after] * n, "normal": [normal] * n}


def test_async_stall_verdict_needs_the_background_save_to_stall_less_and_cost_no_more():
    paying = {"folder": _rounds(3.0, 1.0), "folder-async": _rounds(1.2, 1.1)}  # a GPU: staging only
    ok, detail = gc.async_stall_verdict(paying)
    assert ok is True and "x1.20 in the background vs x3.00 in the step" in detail, detail
    moved = {"folder": _rounds(3.0, 1.0), "folder-async": _rounds(1.2, 3.5)}  # the write competes (a CPU)
    assert gc.async_stall_verdict(moved)[0] is False
    staging_slow = {"folder": _rounds(1.5, 1.0), "folder-async": _rounds(1.6, 1.0)}
    assert gc.async_stall_verdict(staging_slow)[0] is False
    assert gc.async_stall_verdict(None) == (False, "no measurement")
    assert gc.async_stall_verdict({"folder": _rounds(3.0, 1.0)})[0] is False


def test_bench_verdict_skips_one_rank_and_fails_low_bandwidth_or_wrong_results():
    rows = [{"op": "all_reduce", "busbw": "120.5", "wrong": "0"},
            {"op": "all_gather", "busbw": "1", "wrong": "0"}]
    assert gc.bench_verdict(8, rows)[0] is True
    assert gc.bench_verdict(8, [{**rows[0], "busbw": "0.4"}])[0] is False
    assert gc.bench_verdict(8, [{**rows[0], "wrong": "3"}])[0] is False
    assert gc.bench_verdict(8, [])[0] is False
    assert gc.bench_verdict(1, [])[0] is None


def test_the_torch_build_line_names_the_cuda_build_only_where_a_gpu_is_seen():
    smi = "| NVIDIA-SMI 570.1   Driver Version: 570.1   CUDA Version: 12.8 |\n| 0  NVIDIA H100 GPU ..."
    line = gc.cpu_torch_note("2.13.0+cpu", None, smi, _compat.TORCH_FLOOR)
    assert "CPU build" in line and "whl/cu128" in line and "torch==2.13.0 " in line
    assert f">= {_compat.TORCH_FLOOR}" in line and len(line.splitlines()) == 1
    assert gc.cpu_torch_note("2.13.0+cpu", None, None) is None  # no nvidia-smi: nothing to say
    assert gc.cpu_torch_note("2.13.0+cpu", None, "No devices were found") is None
    assert gc.cpu_torch_note("2.13.0+cu128", "12.8", smi) is None  # a CUDA build


def test_world_one_says_what_it_cannot_prove():
    worker = _script("gpu_check_worker")
    one = dict((n, worker.skip_reason(n, "nccl", 1)) for n in worker.NAMES)
    eight = dict((n, worker.skip_reason(n, "nccl", 8)) for n in worker.NAMES)
    gloo = dict((n, worker.skip_reason(n, "gloo-cuda", 2)) for n in worker.NAMES)
    assert all(r is None for r in eight.values())  # on 8 GPUs everything runs
    for name in ("equivalence ddp", "equivalence zero1", "overlap", "comm stats", "join",
                 "find_unused_parameters"):
        assert one[name], name  # a SKIP with its reason, not a PASS
    for name in ("no host sync ddp", "no host sync zero1", "no host sync optimizer_overlap",
                 "memory flat 200 steps", "flight recorder"):
        assert one[name] is None, name  # meaningful on one GPU
    for name in ("equivalence ddp", "equivalence fp16", "join", "find_unused_parameters", "comm stats"):
        assert gloo[name] is None, name  # the 2-rank proof on one GPU
    assert gloo["no host sync ddp"] and gloo["equivalence zero1"] and gloo["overlap"]
    assert [n for n, _ in worker.checks("nccl", None, 1)] == worker.NAMES  # every item is printed


def _frame_in(worker, filename):
    code = compile("def read():\n    return inner()\n", filename, "exec")
    scope = {"inner": lambda: worker.minddp_frame(sys._getframe())}
    exec(code, scope)
    return scope["read"]()


def test_the_sync_watch_attributes_a_sync_to_minddps_innermost_frame():
    worker = _script("gpu_check_worker")
    package = Path(minddp.__file__).parent
    assert _frame_in(worker, str(package / "engine" / "transfer.py")) == "engine/transfer.py:2"
    assert worker.minddp_frame(sys._getframe()) is None  # this test file is not minddp's


@pytest.mark.parametrize("where", [".venv/lib/python3.12/site-packages/torch/optim/optimizer.py",
                                   "tests/dist/test_gpu_paths.py", "scripts/gpu_check_worker.py"])
def test_a_clone_named_minddp_is_not_minddps_code(where):
    """`git clone` names the folder minddp: its .venv (torch), tests/ and scripts/ hold "/minddp/"
    in their paths but are not the package."""
    worker = _script("gpu_check_worker")
    assert _frame_in(worker, os.path.join(os.sep, "tmp", "c", "minddp", where)) is None


def test_the_supported_torch_range_is_pinned():
    assert _compat.TORCH_FLOOR == "2.11"
    assert _compat.torch_supported()  # the pinned 2.13 this machine runs
    assert _compat.torch_supported("2.11.0+cu130") and _compat.torch_supported("2.15.0")
    assert not _compat.torch_supported("2.10.1+cu128")
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"torch==2.13.0"' in pyproject and "torch>=2.11" in pyproject  # the pin, and the floor named
    readme = (ROOT / "README.md").read_text()
    section = readme.split("On a GPU node without internet", 1)[1][:800]
    assert "torch >= 2.11" in section and "make wheelhouse" in section


def test_the_gpu_check_run_fits_its_budget():
    assert gc.BUDGET_S < 600
    assert re.search(r"MFU_FLOOR = 0\.\d+", (ROOT / "scripts" / "gpu_check.py").read_text())


@pytest.mark.slow
def test_the_sigterm_item_runs_end_to_end_on_the_cpu(tmp_path, monkeypatch):
    """The item's machinery without a GPU (the trainer picks the CPU; a small model: the CPU is
    slow): torchrun's workers are signalled after step 5, exit 0, and the checkpoint at the step
    they stopped loads."""
    monkeypatch.setattr(gc, "RESULTS", {})
    tiny = ["model.n_layer=2", "model.n_embd=64", "model.n_head=4", "model.block_size=32",
            "train.micro_batch_size=16", "train.eval_every=0", "wandb.mode=disabled"]
    assert gc.check_sigterm(1, tmp_path, tiny), gc.RESULTS
    word, detail = gc.RESULTS["SIGTERM: exit 0, a loadable checkpoint at the step it stopped"].values()
    assert word == "PASS" and "exit 0" in detail, detail


@pytest.mark.slow
def test_the_folder_checkpoint_item_runs_end_to_end_on_the_cpu(tmp_path, monkeypatch):
    """The item's machinery without a GPU (a small model: the CPU is slow): a background-saved
    folder at step 5 resumes to 8."""
    monkeypatch.setattr(gc, "RESULTS", {})
    tiny = ["model.n_layer=2", "model.n_embd=64", "model.n_head=4", "model.block_size=32",
            "train.micro_batch_size=16", "train.eval_every=0", "wandb.mode=disabled"]
    assert gc.check_folder_checkpoints(1, tmp_path, tiny), gc.RESULTS
    word, detail = gc.RESULTS["folder checkpoints (dcp, background, ZeRO-1)"].values()
    assert word == "PASS" and "[6, 7, 8]" in detail, detail


@pytest.mark.slow
def test_the_async_stall_item_measures_end_to_end_on_the_cpu(tmp_path, monkeypatch):
    """The item's machinery without a GPU (a small model, one round, one rank): the bench runs,
    its numbers reach the verdict. On a CPU the verdict itself may go either way."""
    monkeypatch.setattr(gc, "RESULTS", {})
    gc.check_async_stall(1, tmp_path, model=(2, 64), rounds=1)
    word, detail = gc.RESULTS[gc.ASYNC_STALL].values()
    assert word in ("PASS", "FAIL") and "in the background vs x" in detail, detail
    assert (tmp_path / "ckpt_bench.md").exists()


class _Torch:  # what why_no_cuda reads of torch: a CPU-only build
    __version__ = "2.13.0+cpu"

    class version:
        cuda = None


SMI_WITH_GPU = ("| NVIDIA-SMI 570.1  Driver Version: 570.1  CUDA Version: 12.8 |\n"
                "|   0  NVIDIA H100 80GB HBM3 | GPU")


def test_gpu_check_without_a_gpu_says_so_and_points_to_the_offline_route():
    """A laptop (no nvidia-smi) is told there is no GPU here, not to install a CUDA wheel."""
    line = gc.why_no_cuda(_Torch, None)
    assert "no GPU on this machine" in line and "make wheelhouse" in line and "PYTHON=python3" in line
    assert "install a CUDA wheel" not in line
    on_a_gpu_node = gc.why_no_cuda(_Torch, SMI_WITH_GPU)
    assert "CPU-only build" in on_a_gpu_node and "CUDA wheel" in on_a_gpu_node
