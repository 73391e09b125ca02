"""The door to Flower's internals (common/flower_internals.py): each way a Flower upgrade can
break a name promptfcl relies on is reported, naming it, never silently worked around.

tests/test_layers.py runs the checks against the installed Flower; these make the checks
themselves fail where they must, on real modules (Flower's and the standard library's).
"""

from __future__ import annotations

import numpy as np
import pytest

from promptfcl.common import flower_internals as door
from promptfcl.common.flower_internals import INTERNALS, Internal, check, internal


@pytest.fixture
def entry(monkeypatch):
    """Register a test entry under "probe" for the length of one test."""

    def register(item: Internal) -> str:
        monkeypatch.setitem(INTERNALS, "probe", item)
        return "probe"

    return register


def test_a_name_flower_removed_raises_naming_what_it_was_for(entry):
    name = entry(Internal("flwr.supercore.constant", "NoSuchThing", "a probe's purpose", "a probe's replacement"))
    with pytest.raises(ImportError, match=r"flwr.supercore.constant.NoSuchThing.*a probe's purpose.*a probe's replacement"):
        internal(name)
    assert len(check(name)) == 1
    name = entry(Internal("flwr.no_such_module", "x", "p", "r"))
    with pytest.raises(ImportError, match="flwr.no_such_module.x"):
        internal(name)


def test_a_member_or_parameter_flower_dropped_is_reported(entry):
    # an enum member, a function's parameter and a protobuf field, each present and each missing
    assert not check(entry(Internal("flwr.supercore.constant", "TaskType", "p", "r", uses=("CLIENT_APP",))))
    assert "TaskType.NO_SUCH_TASK" in check(entry(Internal("flwr.supercore.constant", "TaskType", "p", "r",
                                                          uses=("CLIENT_APP", "NO_SUCH_TASK"))))[0]
    run = INTERNALS["run_clientapp"]
    assert "run_clientapp.no_such_parameter" in check(entry(run._replace(uses=("token", "no_such_parameter"))))[0]
    node = INTERNALS["node_info"]
    assert not check(entry(node))
    assert "NodeInfo.no_such_field" in check(entry(node._replace(uses=("status", "no_such_field"))))[0]


def test_a_name_flower_no_longer_reads_is_reported_and_not_rebound(entry, monkeypatch):
    """Rebinding a name the Flower function no longer reads would change nothing, silently."""
    loop = INTERNALS["supernode_loop_time"]
    assert not check(entry(loop))
    name = entry(loop._replace(read_by=("start_client_internal", "time", "no_such_call")))
    assert "read by flwr.supernode.start_client_internal.start_client_internal" in check(name)[0]
    import time

    with pytest.raises(ImportError, match="no effect"):
        door.replace_internal(name, "not a time module")
    assert internal("supernode_loop_time") is time  # untouched
    name = entry(loop._replace(read_by=("no_such_function",)))
    assert check(name)


def test_the_new_place_is_tried_first_then_the_old(entry):
    import json
    import pickle

    assert internal(entry(Internal("json", "dumps", "p", "r", new_module="pickle"))) is pickle.dumps
    assert internal(entry(Internal("json", "dumps", "p", "r", new_module="flwr.compat.no_such_module"))) is json.dumps
    with pytest.raises(ImportError, match=r"no_such_module \(or flwr.compat.no_such\).dumps"):
        internal(entry(Internal("no_such_module", "dumps", "p", "r", new_module="flwr.compat.no_such")))


def test_a_default_flower_dropped_raises(entry):
    name = entry(INTERNALS["pull_message_objects"])
    fn = internal(name)
    before = fn.__kwdefaults__["initial_backoff"]
    try:
        door.set_internal_default(name, "initial_backoff", before / 2)  # what the zygote does
        assert fn.__kwdefaults__["initial_backoff"] == before / 2
    finally:
        fn.__kwdefaults__["initial_backoff"] = before
    with pytest.raises(KeyError, match="no_such_parameter"):
        door.set_internal_default(name, "no_such_parameter", 1.0)


def test_flowers_legacy_aggregation_helpers_compute_what_robust_aggregation_needs():
    """aggregation = "median" / "trimmed-mean" go through the door (Flower moves these helpers)."""
    values = [np.array([1.0, -4.0]), np.array([2.0, 0.0]), np.array([9.0, 1.0]), np.array([3.0, 2.0])]
    layers = [([v], 1) for v in values]
    assert np.allclose(internal("aggregate_median")(layers)[0], [2.5, 0.5])
    assert np.allclose(internal("aggregate_trimmed_avg")(layers, 0.25)[0], [2.5, 0.5])
    from promptfcl.strategies.platform.replies import combine

    weights = np.full(4, 0.25)
    as_float32 = [v.astype(np.float32) for v in values]
    assert combine(as_float32, weights, "median").tolist() == [2.5, 0.5]
    assert combine(as_float32, weights, "trimmed-mean", trim=0.25).dtype == np.float32
