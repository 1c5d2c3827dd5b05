"""CUDA paths caught on CPU where the class of bug allows: MFU and peaks, precision defaults.

What only a GPU can show is `make gpu-check`'s (scripts/gpu_check.py)."""

import math

import pytest
import torch

from minddp.train import flops
from hydra import compose, initialize_config_dir

from minddp.errors import ConfigError
from minddp.train.config import register, validate
from tests.conftest import ROOT

register()


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


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
    assert flops.set_precision("auto", cpu) is False
    assert flops.set_precision(True, cpu) is True
    assert flops.set_precision(False, cpu) is False
    validate(_cfg("train.bf16=auto"), 1)
    with pytest.raises(ConfigError, match="train.bf16 must be true, false or auto"):
        validate(_cfg("train.bf16=maybe"), 1)
