"""Files written and read safely:

    atomic.py       a temporary file, fsync, rename: a crash leaves the old file or the new one
    lock.py         one live job per run directory: an OS lock rank 0 holds for the run's life
    safe_pickle.py  pickles from elsewhere (meta.pkl, flight-recorder dumps) read without running code
"""
