"""make wheelhouse: minddp's Python dependencies in one folder, for a GPU node without internet.

    python scripts/wheelhouse.py [--out wheelhouse] [--pythons "3.10 3.11 3.12 3.13"] [--extras "numpy"]

Run it on a connected machine, copy the folder next to minddp on the node, then `make gpu-check
PYTHON=python3` (or `python3 scripts/gpu_check.py`) installs what that Python lacks from it, with
no index, into a venv that sees the node's own torch. torch itself is never in it: the node's
CUDA build is the one to use (minddp runs on torch >= minddp._compat.TORCH_FLOOR).

Pure-Python wheels (py3-none-any) serve every Python; PyYAML has compiled wheels, so it is fetched
for each --pythons version on x86_64 and aarch64 (a few MB in all). --extras adds optional ones the
same way (numpy if the node lacks it, tokenizers for BPE data, wandb for online tracking:
`wandb.mode=disabled` needs none). setuptools is there so minddp installs (`--no-deps -e .`) offline.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# hydra-core pulls omegaconf, antlr4-python3-runtime (an sdist: built into a wheel here) and packaging
PURE = ["hydra-core>=1.3,<1.4", "omegaconf>=2.2,<2.4", "antlr4-python3-runtime==4.9.*", "packaging",
        "tqdm>=4.60", "setuptools>=68", "wheel"]
COMPILED = ["PyYAML>=5.1"]  # omegaconf's
EXTRAS = {"numpy": "numpy", "tokenizers": "tokenizers==0.23.3", "wandb": "wandb>=0.17",
          "safetensors": "safetensors>=0.4"}  # safetensors: minddp export, model.init_from
PLATFORMS = {"x86_64": ["manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64"],
             "aarch64": ["manylinux2014_aarch64", "manylinux_2_17_aarch64", "manylinux_2_28_aarch64"]}


def commands(out: Path, pythons: list[str], arches: list[str], extras: list[str]) -> list[list[str]]:
    """The pip calls that fill `out` (pure: tested without running them)."""
    unknown = [e for e in extras if e not in EXTRAS]
    if unknown:
        raise SystemExit(f"--extras: unknown {unknown}; choose from {sorted(EXTRAS)}")
    pip = [sys.executable, "-m", "pip"]
    cmds = [[*pip, "wheel", "--no-deps", "--wheel-dir", str(out), *PURE]]
    compiled = COMPILED + [EXTRAS[e] for e in extras]
    for version in pythons:
        for arch in arches:
            platforms = [a for p in PLATFORMS[arch] for a in ("--platform", p)]
            # --no-deps: each extra's own pure-Python dependencies are resolved on the node's side
            cmds.append([*pip, "download", "--no-deps", "--only-binary=:all:", "--python-version", version,
                         *platforms, "--dest", str(out), *compiled])
    return cmds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "wheelhouse"))
    ap.add_argument("--pythons", default="3.10 3.11 3.12 3.13", help="Python versions of the GPU nodes")
    ap.add_argument("--arches", default="x86_64 aarch64")
    ap.add_argument("--extras", default="", help=f"optional: {' '.join(EXTRAS)}")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for cmd in commands(out, args.pythons.split(), args.arches.split(), args.extras.split()):
        print("$", " ".join(cmd[2:]), flush=True)
        subprocess.run(cmd, check=True)
    mb = sum(f.stat().st_size for f in out.iterdir()) / 2**20
    print(f"wheelhouse: {len(list(out.iterdir()))} files, {mb:.1f} MB in {out}; copy it next to minddp "
          "on the GPU node, then: make gpu-check PYTHON=python3")


if __name__ == "__main__":
    main()
