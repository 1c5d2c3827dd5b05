"""data=tokens at its edges: every bad folder is a ConfigError naming the file and the fix, the
id check reads every token, llm.c headers are checked, formats are not mixed, and the
vocabulary is decided (and reported) the same way for nanoGPT, llm.c and build-nanogpt data."""


from minddp.train import data
from tests.files import nanogpt, tokens_config


def _load_agreed(rank, world_size, folders):
    return data.load_data_agreed(tokens_config(folders[rank]), 16)[2].fingerprint


def test_one_ranks_broken_file_is_the_same_error_on_every_rank_at_once(tmp_path):
    from tests import launch

    good, bad = nanogpt(tmp_path / "good"), nanogpt(tmp_path / "bad")
    (bad / "train.bin").write_bytes(b"")
    t0 = __import__("time").monotonic()
    errors = launch.ranks_expect_errors(_load_agreed, 2, [good, bad], timeout=60)
    assert __import__("time").monotonic() - t0 < 20
    want = f"ConfigError: on rank 1 (1 of 2 ranks failed): {bad}/train.bin is empty"
    assert all(want in errors[r] for r in (0, 1)), errors


def test_ranks_reading_different_files_is_an_error_on_every_rank(tmp_path):
    from tests import launch

    a, b = nanogpt(tmp_path / "a"), nanogpt(tmp_path / "b", n_train=500)
    errors = launch.ranks_expect_errors(_load_agreed, 2, [a, b], timeout=60)
    for r in (0, 1):
        assert "ConfigError: the ranks read different data (fingerprints rank 0: " in errors[r], errors[r]
        assert f"from {a}; rank 1: " in errors[r] and f"from {b})" in errors[r]
    assert len(set(launch.ranks(_load_agreed, 2, [a, a], timeout=60))) == 1
