"""Who is stuck where: `minddp debug <run dir>` reads every rank's flight-recorder dump.

The dumps are torch's own (written by minddp.train.metrics.flight_recorder on an exception, a
collective timeout or SIGTERM), plus minddp's context per rank (step, phase, group ranks).
The answer names, group by group, each rank's last collective and who never called the
one the others wait in. The reading is minddp/perf/flight.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..perf.flight import DumpError, analyze
from ..train.io import safe_pickle


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: minddp debug <run dir>\n\n" + __doc__)
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    if not Path(argv[0]).is_dir():
        print(f"minddp debug: {argv[0]} is not a folder: give the run dir (it holds flight_recorder/)",
              file=sys.stderr)
        raise SystemExit(2)
    try:
        print(analyze(argv[0], safe_pickle.load))
    except DumpError as e:
        print(f"minddp debug: {e}. Move it away (or re-run for a fresh dump) and try again", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
