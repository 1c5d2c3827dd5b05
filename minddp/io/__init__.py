"""Files written and read safely, for every layer (it stands on the standard library alone):

    atomic.py       a temporary file, fsync, rename: a crash leaves the old file or the new one
    safe_pickle.py  pickles from elsewhere (meta.pkl, flight-recorder dumps, DCP's index) read
                    without running code
"""
