"""Record encoding round trips and payload sizes."""

import numpy as np
import torch
from flwr.app import ConfigRecord, RecordDict

from promptfcl.common.records import from_array_record, payload_bytes, to_array_record, to_torch


def test_round_trip_preserves_names_values_and_dtypes():
    state = {"prompt.p0": torch.randn(4, 2, 8), "head.weight": torch.randn(10, 8), "x16": torch.ones(3, dtype=torch.float16)}
    back = to_torch(to_array_record(state))
    assert list(back) == list(state)
    for k in state:
        assert back[k].dtype == state[k].dtype and torch.equal(back[k], state[k])
    np.testing.assert_array_equal(from_array_record(to_array_record({"a": np.arange(5)}))["a"], np.arange(5))


def test_payload_bytes_track_the_data_size():
    small = RecordDict({"arrays": to_array_record({"w": np.zeros(10, np.float32)}), "config": ConfigRecord({"task": 1})})
    big = RecordDict({"arrays": to_array_record({"w": np.zeros(100_000, np.float32)}), "config": ConfigRecord({"task": 1})})
    assert abs(payload_bytes(big) - payload_bytes(small) - 4 * (100_000 - 10)) < 32  # varint framing
    assert payload_bytes(small) < 2000
