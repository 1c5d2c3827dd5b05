"""A trained GPT for Hugging Face `transformers`: `minddp export RUN_DIR|CKPT --to DIR`.

    minddp export outputs/2026-11-30/12-00-00 --to my-gpt
    minddp export outputs/run/checkpoints/ckpt_00000200 --to my-gpt-200 --no-torch-file

Takes a run directory (its newest complete checkpoint) or one checkpoint (a ckpt_<step>.pt file
or a ckpt_<step> folder). DIR gets what `GPT2LMHeadModel.from_pretrained(DIR)` reads, in
save_pretrained's layout:
  config.json        model_type gpt2, the sizes, activation_function (gelu, or gelu_new for
                     model.activation=gelu_tanh: what the model computed), tied embeddings
  model.safetensors  the weights, float32, GPT-2's names (Conv1D weights transposed)
and, for scripts that want one file (unless --no-torch-file):
  checkpoint.pt      the whole checkpoint in one torch.save file: a folder checkpoint
                     (train.ckpt_format=dcp) through torch's dcp_to_torch_save (keys
                     "model/<name>", "optimizer/..."); a ckpt_<step>.pt as it is (keys "model", ...)
transformers' logits equal minddp's to float rounding (README, "To and from Hugging Face").
DIR must be new or empty; it appears whole or not at all. Writing needs `safetensors` only.
"""

from __future__ import annotations

import os
import shutil
import sys
import uuid
from pathlib import Path

from ..errors import ConfigError
from ..model import hf_gpt2
from ..train.checkpoint import all_checkpoints, format_of, is_checkpoint_folder
from .arguments import tool_parser
from .sample import SampleError, read_checkpoint

TORCH_FILE = "checkpoint.pt"


class ExportError(ConfigError):
    """Input that cannot be exported: one line naming the fix, exit 2."""


def checkpoint_of(target: Path) -> tuple[Path, dict]:
    """The checkpoint to export and its loaded state: `target` itself, or a run directory's
    newest complete one (a corrupt newer one is named and the previous one used)."""
    if not target.exists():
        raise ExportError(f"{target} does not exist: give a run directory or a checkpoint (a ckpt_<step>.pt "
                          "file or a ckpt_<step> folder)")
    if target.is_dir() and not is_checkpoint_folder(target) and not all_checkpoints(target):
        raise ExportError(f"{target} holds no complete checkpoint ({target}/checkpoints/ckpt_<step>): export "
                          "a run that saved one (train.ckpt_every, or the run's end), or give a checkpoint")
    try:
        return read_checkpoint(target, lambda line: print(f"minddp export: warning: {line}", file=sys.stderr))
    except SampleError as e:
        raise ExportError(str(e)) from None


def model_config(path: Path, state: dict) -> dict:
    config = state.get("config")
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise ExportError(f"{path} has no saved config (written by minddp before 0.4): its model's sizes "
                          "are unknown; export a checkpoint of a newer run")
    return config["model"]


def check_destination(dest: Path) -> None:
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ExportError(f"--to {dest} exists and is not an empty folder: remove it or give a new folder")


def write_torch_file(path: Path, out: Path) -> None:
    """One torch.save file of a checkpoint: torch's own converter for a folder, a copy of a file."""
    format_of(path).to_torch_file(path, out)


def export(path: Path, state: dict, dest: Path, torch_file: bool) -> None:
    """Everything into a temporary folder beside `dest`, renamed into place at the end: an
    interrupted export leaves no half-written model where a loader would find it."""
    tensors, config = hf_gpt2.to_hf(state["model"], model_config(path, state))
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        hf_gpt2.write(tmp, tensors, config)
        if torch_file:
            write_torch_file(path, tmp / TORCH_FILE)
        if dest.exists():
            dest.rmdir()  # empty (checked): the rename takes its place
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main(argv=None) -> None:
    ap = tool_parser("export", __doc__)  # a bad argument: one line, exit 2 (minddp.tools.arguments)
    ap.add_argument("target", type=Path, help="a run directory, or a checkpoint (file or folder)")
    ap.add_argument("--to", type=Path, required=True, help="the folder to write (new or empty)")
    ap.add_argument("--no-torch-file", action="store_true",
                    help=f"write only the Hugging Face files, not {TORCH_FILE}")
    args = ap.parse_args(argv)
    try:
        check_destination(args.to)
        path, state = checkpoint_of(args.target)
        export(path, state, args.to, not args.no_torch_file)
    except ConfigError as e:  # ExportError, HFError: the input
        print(f"minddp export: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except OSError as e:  # a full disk, a folder that cannot be written: nothing was left behind
        print(f"minddp export: could not write {args.to}: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    m = state["config"]["model"]
    files = ", ".join(sorted(os.listdir(args.to)))
    print(f"minddp export: {path} (step {state['step']}, {m['n_layer']} layers, activation "
          f"{m.get('activation', 'gelu')}) -> {args.to}: {files}\n"
          f"  load it: GPT2LMHeadModel.from_pretrained({str(args.to)!r})")


if __name__ == "__main__":
    main()
