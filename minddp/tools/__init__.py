"""minddp's command-line tools, behind one entry point: `minddp <tool> ...` (console script)
or `python -m minddp <tool> ...`; `torchrun ... -m minddp <tool> ...` for the distributed ones.

Each tool is one module here with a `main()` that reads `sys.argv`; only the chosen one is imported.
"""

from __future__ import annotations

import importlib
import sys

from minddp.errors import ConfigError

# tool name -> (module under minddp.tools, one line for `minddp --help`)
TOOLS = {
    "prepare": ("prepare", "text to token files for data=tokens (bytes or BPE)"),
    "sample": ("sample", "generate text from a trained run's checkpoint"),
    "export": ("export", "a trained GPT as a Hugging Face transformers GPT-2 folder (+ one torch.save file)"),
    "report": ("report", "every run under a folder: one table and one plot"),
    "debug": ("debug", "read a run's flight-recorder dumps: who is stuck where"),
    "costmodel": ("costmodel", "alpha-beta cost model: all-reduce, DDP step, ZeRO-1, tree, presets"),
    "bench": ("bench", "nccl-tests-style collective sweep, alpha-beta fit (torchrun)"),
    "calibrate": ("calibrate", "what the cost model needs on this machine: docs/calibration.json (torchrun)"),
    "bench-ddp": ("bench_ddp", "minddp vs torch DDP per bucket cap, per-bucket CPU cost (torchrun)"),
    "bench-host": ("bench_host", "host cost, many small tensors: minddp vs torch DDP (torchrun)"),
    "bench-trainer": ("bench_trainer", "the trainer's step vs bare torch-DDP loops (torchrun)"),
    "bench-memory": ("bench_memory", "peak memory per rank: torch DDP, minddp DDP, ZeRO-1"),
    "bench-debug": ("bench_debug", "cost of the flight recorder per collective (torchrun)"),
    "timeline": ("timeline", "one step per rank as a Perfetto trace and a PNG (torchrun)"),
    "scaling": ("scaling", "the trainer over world sizes and caps, beside the cost model"),
}


def usage() -> str:
    width = max(map(len, TOOLS))
    rows = "\n".join(f"  {name:<{width}}  {line}" for name, (_, line) in TOOLS.items())
    return ("usage: minddp <tool> [args...]    (also: python -m minddp <tool>)\n\n"
            f"tools:\n{rows}\n\n`minddp <tool> --help` for a tool's own options.")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        raise SystemExit(0 if argv else 2)
    name = argv[0].replace("_", "-")
    if name not in TOOLS:
        print(f"minddp: unknown tool {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        raise SystemExit(2)
    module = importlib.import_module(f"minddp.tools.{TOOLS[name][0]}")
    sys.argv = [f"minddp {name}", *argv[1:]]  # each tool's argparse reads sys.argv
    try:
        module.main()
    except ConfigError as e:  # e.g. more nccl ranks than GPUs: one line and exit 2 on every rank
        from ..parallel.dist import env_rank  # (torch: imported once a tool ran, never for --help)

        sys.stderr.write(f"[rank {env_rank()}] minddp {name}: configuration error: {e}\n")  # one write
        raise SystemExit(2) from None
