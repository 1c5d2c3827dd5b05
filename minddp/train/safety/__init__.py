"""What keeps a multi-rank run from hanging, or from going wrong silently:

    together.py     fail together: any rank's error is raised on every rank, naming the rank
    signals.py      SIGTERM/SIGUSR1/SIGINT as a stop request every rank acts on at the same step
    guard.py        too many skipped (non-finite) steps in a row stop the run, naming the cause
    consistency.py  data-parallel replicas compared; a difference is an error on every rank
    faults.py       fault injection (train.fault_*), to rehearse the paths above
"""
