"""What a run trains on:

    sources.py      token folders, a text corpus, a synthetic task: map-style data sets of
    windows, opened, checked and agreed by every rank; DataInfo says what was found
    tokens.py       token files of nanoGPT, llm.c and build-nanogpt: found, opened, checked
    fingerprint.py  a hash of the data files, so a resume or a rank reading other bytes is refused
    batches.py      this rank's micro-batches for any step (DistributedSampler's order)

Text -> token files is `minddp prepare`'s (minddp/tools/prepare.py).

The names of the former minddp/train/data.py are importable from here.
"""

from .batches import ShardedBatches, collate
from .sources import (
    ArithmeticSequences,
    DataInfo,
    TokenWindows,
    corpus_files,
    corpus_key,
    load_corpus,
    load_data,
    load_data_agreed,
    load_tokens,
    record_in_config,
    stdlib_root,
)

__all__ = ["ArithmeticSequences", "DataInfo", "ShardedBatches", "TokenWindows", "collate", "corpus_files",
           "corpus_key", "load_corpus", "load_data", "load_data_agreed", "load_tokens", "record_in_config",
           "stdlib_root"]
