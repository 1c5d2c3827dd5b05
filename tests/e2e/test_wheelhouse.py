"""make wheelhouse and make gpu-check on an offline node: the node's Python lacks hydra-core,
omegaconf and tqdm and has a torch of its own; gpu_check.py installs what it lacks from the
wheelhouse with no index (pip's configuration and index out of reach) into a venv that sees
that torch, never a second torch, then runs again under it."""


import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.conftest import ROOT

# torch and what `import torch` needs, taken from this venv as the node's "system" torch
TORCH = ["torch", "torchgen", "functorch", "filelock", "fsspec", "jinja2", "markupsafe", "mpmath", "networkx",
         "sympy", "typing_extensions.py", "torch-*.dist-info"]


def _system_torch(folder: Path) -> Path:
    here = Path(next(p for p in sys.path if p.endswith("site-packages") and Path(p, "torch").is_dir()))
    folder.mkdir()
    for pattern in TORCH:
        for path in here.glob(pattern):
            (folder / path.name).symlink_to(path)
    return folder


def _node_python(tmp_path: Path) -> Path:
    """The base interpreter's packages (a system Python) and torch from a folder of its own."""
    node = tmp_path / "node"
    venv.create(node, system_site_packages=True, with_pip=False)
    python = node / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "system_torch.pth").write_text(str(_system_torch(tmp_path / "system-torch")) + "\n")
    return python


@pytest.mark.slow
def test_an_offline_node_installs_what_it_lacks_and_keeps_its_own_torch(tmp_path):
    node = _node_python(tmp_path)
    lacks = subprocess.run([str(node), "-c", "import hydra"], capture_output=True).returncode
    has_numpy = subprocess.run([str(node), "-c", "import numpy"], capture_output=True).returncode == 0
    assert lacks != 0, "the node must lack hydra for this test to prove anything"
    wheels = tmp_path / "wheelhouse"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "wheelhouse.py"), "--out", str(wheels),
                    "--pythons", version, "--arches", "x86_64", "--extras", "" if has_numpy else "numpy"],
                   check=True, capture_output=True, timeout=300)
    assert not list(wheels.glob("torch*")), "torch never goes into the wheelhouse"
    offline = {"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "", "PIP_NO_INDEX": "1",
               "PIP_CONFIG_FILE": os.devnull, "HOME": str(tmp_path)}
    gpu_venv = tmp_path / "gpu-venv"
    p = subprocess.run([str(node), str(ROOT / "scripts" / "gpu_check.py"), "--wheelhouse", str(wheels),
                        "--venv", str(gpu_venv), "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, env=offline, timeout=300)
    lines = p.stdout.splitlines()
    assert p.returncode == 1, p.stdout + p.stderr
    assert "installing" in lines[0] and "hydra-core" in lines[0] and "(no index)" in lines[0], lines
    # it ran again under the venv and got past the imports, to the CUDA check
    assert "nothing was checked" in lines[-1] and "CPU-only build" in lines[-1], lines
    q = subprocess.run([str(gpu_venv / "bin" / "python"), "-c",
                        "import hydra, omegaconf, tqdm, yaml, numpy, torch, minddp; print(torch.__file__)"],
                       capture_output=True, text=True, env=offline, timeout=120)
    assert q.returncode == 0, q.stderr
    assert str(tmp_path / "system-torch") in q.stdout  # the node's torch, not a second one
    site = next((gpu_venv / "lib").glob("python*/site-packages"))
    assert not list(site.glob("torch*")), "torch was installed into the venv"
    assert list(site.glob("hydra*")) and list(site.glob("omegaconf*"))
