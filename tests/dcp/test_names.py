"""DCP checkpoint ids are store checkpoint names: one validation shared by the writer and the reader."""

from __future__ import annotations

import pathlib

import pytest

from deltackpt.dcp import DeltaStorageReader, DeltaStorageWriter, checkpoint_name
from deltackpt.errors import InvalidNameError


def test_checkpoint_name_accepts_names_and_paths():
    assert checkpoint_name("step-100") == "step-100"
    assert checkpoint_name(pathlib.PurePosixPath("step-100")) == "step-100"


@pytest.mark.parametrize("bad", ["a/b", "..", ".hidden", "", "latest", "x" * 129])
def test_checkpoint_name_rejects_bad_names_with_a_typed_error(bad):
    with pytest.raises(InvalidNameError):
        checkpoint_name(bad)


def test_checkpoint_name_rejects_non_strings_with_value_error():
    with pytest.raises(ValueError, match="must be a string name, got int") as e:
        checkpoint_name(100)
    assert not isinstance(e.value, InvalidNameError)


def test_writer_and_reader_validate_ids_alike():
    for cls in (DeltaStorageWriter, DeltaStorageReader):
        assert cls.validate_checkpoint_id("step-1") and cls.validate_checkpoint_id(pathlib.Path("step-1"))
        assert not cls.validate_checkpoint_id("../escape") and not cls.validate_checkpoint_id(7)
    assert DeltaStorageReader.validate_checkpoint_id("latest")  # the newest checkpoint
    assert not DeltaStorageWriter.validate_checkpoint_id("latest")  # reserved: cannot be saved to
