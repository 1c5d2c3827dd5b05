"""Who is stuck where: `minddp debug <run dir>` reads every rank's flight-recorder dump.

The dumps are torch's own (written by minddp.train.metrics.flight_recorder on an exception, a
collective timeout or SIGTERM), plus minddp's context per rank (step, phase, group ranks).
The answer names, group by group, each rank's last collective and who never called the
one the others wait in. The reading is minddp/perf/flight.py.
"""

from __future__ import annotations

import sys

from ..io import safe_pickle
from ..perf.flight import DumpError, analyze
from .arguments import existing_dir, tool_parser


def main(argv=None) -> None:
    ap = tool_parser("debug", __doc__)
    ap.add_argument("run_dir", type=existing_dir, help="the run's folder (it holds flight_recorder/)")
    run_dir = ap.parse_args(argv).run_dir
    try:
        print(analyze(run_dir, safe_pickle.load))
    except DumpError as e:
        print(f"minddp debug: {e}. Move it away (or re-run for a fresh dump) and try again", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
