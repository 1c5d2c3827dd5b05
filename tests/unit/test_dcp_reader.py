"""A planted folder checkpoint runs no code (minddp/train/checkpoint/dcp_reader.py): DCP's
`.metadata` is a pickle, and torch's FileSystemReader reads it with a plain pickle.load. A folder
whose `.metadata` carries a payload (integrity.json recomputed, as anyone can) is corrupt to every
reader (load, resume's choice, export's converter), and its payload never runs."""

import json
import pickle

import pytest
import torch

from minddp.train.checkpoint import FOLDER, CheckpointError, dcp_reader, folders, resolve
from tests.files import TINY_STATE, write_folder
from tests.planted import Payload, replant

STATE = {**TINY_STATE, "model": {"w": torch.arange(6.0).view(2, 3)}, "step": 2}


@pytest.fixture
def planted(tmp_path):
    write_folder(tmp_path / "checkpoints" / "ckpt_00000002", STATE)
    bad = write_folder(tmp_path / "checkpoints" / "ckpt_99999999", STATE)
    marker = tmp_path / "ran"
    replant(bad, pickle.dumps(Payload(marker)))
    folders.verify_files(bad, json.loads((bad / folders.INTEGRITY).read_text()))  # only its content is bad
    return bad, marker


def test_a_payload_in_metadata_is_refused_by_load_and_export_and_never_runs(planted, tmp_path):
    bad, marker = planted
    pickle.loads(pickle.dumps(Payload(tmp_path / "works")))  # the payload does run under pickle
    assert (tmp_path / "works").exists()
    with pytest.raises(CheckpointError, match="is corrupt: DCP's .metadata was refused: refused to load "
                                              "builtins.exec"):
        FOLDER.load(bad, "cpu")
    with pytest.raises(dcp_reader.UnsafeIndex, match="refused to load builtins.exec"):
        FOLDER.to_torch_file(bad, tmp_path / "out.pt")
    assert not marker.exists()


def test_resume_falls_back_past_a_planted_folder(planted, tmp_path):
    bad, marker = planted
    path, state = resolve(tmp_path, "auto", "cpu")
    assert path.name == "ckpt_00000002" and state["step"] == 2
    assert not marker.exists()


def test_a_good_folder_still_loads_and_converts_through_the_safe_reader(tmp_path):
    good = write_folder(tmp_path / "ckpt_00000002", STATE)
    assert torch.equal(FOLDER.load(good, "cpu")["model"]["w"], STATE["model"]["w"])
    FOLDER.to_torch_file(good, tmp_path / "out.pt")
    assert torch.equal(torch.load(tmp_path / "out.pt", weights_only=True)["model/w"], STATE["model"]["w"])


def test_an_index_with_a_non_tensor_entry_or_a_path_outside_is_refused(tmp_path):
    """DCP loads a non-tensor entry with torch.load(weights_only=False): minddp writes none."""
    from torch.distributed.checkpoint import metadata as m

    good = write_folder(tmp_path / "ckpt_00000002", STATE)
    index = dcp_reader.read_index((good / ".metadata").read_bytes())
    index.state_dict_metadata["extra"] = m.BytesStorageMetadata()
    with pytest.raises(dcp_reader.UnsafeIndex, match="BytesStorageMetadata"):
        dcp_reader.read_index(pickle.dumps(index))
    del index.state_dict_metadata["extra"]
    next(iter(index.storage_data.values())).relative_path = "../../etc/passwd"
    with pytest.raises(dcp_reader.UnsafeIndex, match="outside its folder"):
        dcp_reader.read_index(pickle.dumps(index))
    with pytest.raises(dcp_reader.UnsafeIndex, match="not DCP's Metadata"):
        dcp_reader.read_index(pickle.dumps({"state_dict_metadata": {}}))
