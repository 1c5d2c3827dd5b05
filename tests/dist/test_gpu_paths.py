"""CUDA paths caught on CPU where the class of bug allows: MFU and peaks, precision defaults.

What only a GPU can show is `make gpu-check`'s (scripts/gpu_check.py)."""


import math
import os
import sys

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import minddp
from minddp.train.config import register, validate
from minddp.train.metrics import flops
from tests import launch
from tests.conftest import compose_config
from tests.models import MLP, batch, shard

register()


def test_mfu_above_one_is_never_reported():
    # a peak underestimated 5x (a measured matmul on a loaded CPU) would read 500%
    tflops, mfu = flops.utilisation(1e6, 1e6, 0.2e-3, 1)
    assert tflops == pytest.approx(1.0)
    assert mfu is None
    assert flops.utilisation(1e6, 1e6, 4.0, 1)[1] == pytest.approx(0.25)
    assert flops.utilisation(1e6, 1e6, float("nan"), 2)[1] is None  # some rank's peak unknown
    assert flops.utilisation(1e6, 1e6, None, 2)[1] is None


def test_measured_peak_is_the_best_of_several_windows(monkeypatch):
    calls = []
    monkeypatch.setattr(flops, "_sync", lambda device: calls.append(device))
    peak = flops.measured_peak_tflops(torch.device("cpu"), seconds=0.01, repeats=3, n=64)
    assert peak > 0 and math.isfinite(peak)
    assert len(calls) > 3  # one before timing, then one per matmul: the clock reads finished work


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.0), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA GeForce RTX 4090", None),
])
def test_table_peaks_tell_variants_apart(name, peak):
    assert flops.table_peak(name) == peak


def test_bf16_auto_is_off_on_cpu_and_explicit_settings_win():
    cpu = torch.device("cpu")
    assert flops.autocast_bf16(None, cpu) is False  # train.bf16=null (the default): auto
    assert flops.autocast_bf16(True, cpu) is True
    assert flops.autocast_bf16(False, cpu) is False
    validate(compose_config("train.bf16=null"), 1)


def test_tf32_is_the_visible_setting_and_the_bf16_decision_touches_no_flag():
    """train.tf32 sets torch's TF32 flags on CUDA (default on: as before), never on CPU; deciding
    bf16 autocast (the throughput setup) leaves them alone."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    before = (matmul.allow_tf32, cudnn.allow_tf32)
    try:
        flops.set_tf32(False, torch.device("cuda"))
        assert (matmul.allow_tf32, cudnn.allow_tf32) == (False, False)
        flops.autocast_bf16(None, torch.device("cpu"))
        flops.set_tf32(True, torch.device("cpu"))  # no effect on CPU
        assert (matmul.allow_tf32, cudnn.allow_tf32) == (False, False)
        flops.set_tf32(True, torch.device("cuda"))
        assert (matmul.allow_tf32, cudnn.allow_tf32) == (True, True)
        assert compose_config().train.tf32 is True
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = before


# ------------------------------------------------- no host sync in a steady step
class SyncSentinel(TorchFunctionMode):
    """Records every call from minddp code that would block the host on a CUDA tensor: reading
    a value (item, tolist, bool, float, int, numpy, cpu) or building a tensor from host data
    (torch.tensor: a pageable host-to-device copy). minddp/engine/transfer.py is the one place allowed
    to, with pinned memory and non_blocking copies (read there by eye). An explicit wait
    (Event.synchronize, Stream.synchronize, torch.cuda.synchronize) from minddp code counts
    everywhere, transfer.py included: those are not torch functions, so the sentinel counts
    them through a monkeypatch for as long as it is on (on the CPU nothing calls them)."""

    READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "cpu"}
    BUILDS = {"tensor", "as_tensor"}
    WAITS = ((torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize"),
             (torch.cuda, "synchronize"))

    def __init__(self):
        super().__init__()
        self.calls = []
        self._waits = pytest.MonkeyPatch()

    def __enter__(self):
        for owner, name in self.WAITS:
            self._waits.setattr(owner, name, self._counted(getattr(owner, name), owner, name))
        return super().__enter__()

    def __exit__(self, *exc):
        self._waits.undo()
        return super().__exit__(*exc)

    def _counted(self, wait, owner, name):
        label = f"{getattr(owner, '__name__', owner)}.{name}"

        def counted(*args, **kwargs):
            where = in_minddp(sys._getframe(1))
            if where:
                self.calls.append(f"{label} at {where}")
            return wait(*args, **kwargs)

        return counted

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name == "backward":  # a mode is off inside its own handler: run the engine under it,
            with self:  # so the engine's hooks and end-of-backward callback are watched too
                loss = args[0]
                torch.autograd.graph._engine_run_backward(
                    (loss,), (torch.ones_like(loss),), False, False, (), allow_unreachable=True,
                    accumulate_grad=True)
            return None
        if name in self.READS | self.BUILDS:
            where = in_minddp(sys._getframe(1))
            if where and not where.startswith("engine/transfer.py:"):
                self.calls.append(f"{name} at {where}")
        return func(*args, **(kwargs or {}))


# minddp's code is the package's own folder, not any path holding "/minddp/" (a clone named
# minddp: its .venv with torch, its tests/)
PACKAGE = os.path.join(os.path.dirname(os.path.abspath(minddp.__file__)), "")


def in_minddp(frame) -> str | None:
    """'engine/ddp.py:120' when the frame's code lies in minddp's package, else None."""
    path = os.path.abspath(frame.f_code.co_filename)
    return f"{path[len(PACKAGE):]}:{frame.f_lineno}" if path.startswith(PACKAGE) else None


def _engine_and_optimizer(kind):
    torch.manual_seed(0)
    model = MLP()
    if kind == "zero1":
        ddp = minddp.DDP(model, shard_optimizer=True, bucket_cap_mb=1e-6)
        return ddp, minddp.ShardedOptimizer(ddp, torch.optim.AdamW, lr=1e-3)
    if kind == "optimizer_overlap":
        ddp = minddp.DDP(model, optimizer_overlap=True, bucket_cap_mb=1e-6)
        return ddp, minddp.OverlappedOptimizer(ddp, torch.optim.AdamW, lr=1e-3)
    ddp = minddp.DDP(model, bucket_cap_mb=1e-6)
    return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3)


def _steps_under_sentinel(rank, world_size, kind):
    ddp, opt = _engine_and_optimizer(kind)

    def step(i):
        x, y = batch(i, world_size)
        nn.functional.mse_loss(ddp(shard(x, rank)), shard(y, rank)).backward()
        if kind != "optimizer_overlap":  # it refuses clipping (the norm needs every bucket first)
            (opt if kind == "zero1" else ddp).clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    with SyncSentinel() as first:
        step(0)  # the first iteration rebuilds the buckets: one broadcast plan read on the host
    for i in range(1, 3):
        step(i)
    with SyncSentinel() as steady:
        step(3)
        step(4)  # its forward reads step 3's usage flags
    return first.calls, steady.calls


@pytest.mark.parametrize("kind", ["ddp", "zero1", "optimizer_overlap"])
def test_no_host_sync_in_a_steady_step(kind):
    for first, steady in launch.ranks(_steps_under_sentinel, 2, kind, timeout=90):
        assert steady == [], f"{kind}: host syncs in the steady step: {steady}"
        assert any("tolist at engine/" in c for c in first), first  # the sentinel sees the engine


def test_the_sentinel_counts_explicit_waits_from_minddp_code():
    """The three waits, called from code whose file lies in minddp's package (on this CPU-only torch each
    then fails: what matters is that the sentinel saw it first)."""
    probe = compile(
        "for wait in (torch.cuda.synchronize, torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize):\n"
        "    try:\n"
        "        wait() if wait is torch.cuda.synchronize else wait(None)\n"
        "    except (AssertionError, RuntimeError, TypeError, AttributeError):\n"
        "        pass\n", os.path.join(PACKAGE, "probe.py"), "exec")
    with SyncSentinel() as sentinel:
        exec(probe, {"torch": torch})
    assert [c.split(" at ")[0] for c in sentinel.calls] == [
        "torch.cuda.synchronize", "Event.synchronize", "Stream.synchronize"], sentinel.calls
    assert torch.cuda.synchronize.__module__ == "torch.cuda"  # and put back afterwards


def test_the_sentinel_ignores_torch_in_a_clone_named_minddp():
    """`git clone` names the folder minddp; torch in its .venv is not minddp's code."""
    elsewhere = os.path.join(os.sep, "tmp", "c", "minddp", ".venv", "lib", "torch", "optim", "optimizer.py")
    mine = os.path.join(PACKAGE, "optim", "probe.py")
    with SyncSentinel() as sentinel:
        for filename in (elsewhere, mine):
            exec(compile("torch.ones(1).item()\n", filename, "exec"), {"torch": torch})
    assert sentinel.calls == ["item at optim/probe.py:1"], sentinel.calls


def test_bench_ranks_on_gpus_are_not_pinned_and_reports_say_how_ranks_ran(monkeypatch):
    from minddp.tools import cli

    pinned = []
    monkeypatch.setattr(cli, "pin_to_core", lambda: pinned.append(True))
    monkeypatch.setattr(cli, "init_distributed", lambda device: device)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cli.start("auto", pin=True) == "auto" and pinned == []  # auto on a GPU node: nccl
    assert cli.start("nccl", pin=True) == "cuda" and pinned == []
    assert cli.start("gloo", pin=True) == "cpu" and pinned == [True]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    assert cli.ranks_phrase(8, torch.device("cuda", 0)) == "8 nccl ranks, one NVIDIA H100 80GB HBM3 each"
    assert "gloo ranks pinned" in cli.ranks_phrase(2, torch.device("cpu"))


def test_flight_recorder_dumps_nccls_own_recorder_on_nccl(monkeypatch):
    """NCCL keeps its collectives in its own recorder: gloo's dump is empty there."""
    from minddp import _compat

    c10d = torch._C._distributed_c10d
    monkeypatch.setattr(c10d, "_dump_nccl_trace", lambda **kw: b"nccl:" + repr(sorted(kw)).encode(),
                        raising=False)
    assert _compat.dump_flight_recorder("nccl").startswith(b"nccl:")
    assert _compat.dump_flight_recorder("cpu:gloo,cuda:nccl").startswith(b"nccl:")
    assert not _compat.dump_flight_recorder("gloo").startswith(b"nccl:")  # gloo's own pickle
