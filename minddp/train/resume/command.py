"""The exact command that continues a stopped run, printed when it stops (a signal,
train.stop_at_step): this launch's overrides, less those that would stop it again."""

from __future__ import annotations

import os
import shlex
import sys

# overrides that must not come back on resume: it would stop again at once, or inject a fault again
_DROP = ("train.resume=", "train.stop_at_step=", "train.fault_", "+train.resume=", "++train.resume=")


def resume_command(run_dir, argv=None, env=None) -> str:
    """The command that continues this run in its run dir (this launch's overrides kept)."""
    argv = sys.argv if argv is None else argv
    env = os.environ if env is None else env
    script = argv[0] if argv else "train.py"
    args = [a for a in argv[1:] if not a.startswith(_DROP)] + [f"train.resume={run_dir}"]
    if "TORCHELASTIC_RUN_ID" not in env:
        return shlex.join(["python", script, *args])
    if env.get("GROUP_WORLD_SIZE", "1") == "1":
        return shlex.join(["torchrun", "--standalone", f"--nproc_per_node={env.get('LOCAL_WORLD_SIZE', '1')}",
                           script, *args])
    return "your launch command (on every node) with: " + shlex.join([script, *args])
