"""Broken and hostile clients: nothing a reply holds may crash the server, lose results or take over the model.

The replies here are made by the real ClientApp (in this process, :class:`InProcessGrid`)
and then corrupted by Flower mods written for these tests, not by the project's own fault
switch, so the checks do not share code with what they check.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict

from promptfcl.common.config.experiment import ConfigError, ExperimentConfig
from promptfcl.common.model.runtime import get_runtime
from promptfcl.common.records import ARRAYS, METRICS, PLACEMENT, from_array_record, to_array_record
from promptfcl.strategies.platform.replies import capped_weights
from promptfcl.strategies.registry import check_namespaces, strategy_class
from tests.conftest import tiny_config
from tests.helpers import InProcessGrid, client_app, run_in_process

METHODS = ("fedavg", "hepco", "fppl", "hgp", "fedcprompt", "powder", "c2prompt", "lorm", "pilora")
FAST_OPTIONS = {"hepco.generator-epochs": 1, "hepco.distill-epochs": 1, "hgp.samples-per-class": 8,
                # task-level early stopping keeps each task's best model across aggregations, and
                # these tests aggregate one round many times over: the local reading keeps none
                "fedcprompt.early-stopping-scope": "local"}


def method_config(method: str, **overrides) -> ExperimentConfig:
    options = {k: v for k, v in FAST_OPTIONS.items() if k.startswith(method + ".")}
    return tiny_config(strategy=method, **{"num-clients": 3, "clients-per-round": 3, **options, **overrides})


def reply_mod(change: Callable[[RecordDict, Message], RecordDict]) -> Callable:
    """A Flower mod that replaces a train reply's content by ``change(content, request)``."""
    def mod(msg: Message, context, call_next):
        reply = call_next(msg, context)
        if msg.metadata.message_type != MessageType.TRAIN or reply.has_error():
            return reply
        return Message(content=change(copy.deepcopy(reply.content), msg), reply_to=msg)
    return mod


def one_round(method: str):
    """A strategy after task start, the round's messages and the real clients' replies; defended,
    as a run facing hostile replies is (a finite but huge update is left to the norm filter)."""
    cfg = method_config(method, defences="on")
    cls = strategy_class(method)
    rt = get_runtime(cfg, cls.prompt_class)
    strategy = cls.of(cfg, rt.data.num_classes, cfg.method_options(method))
    strategy.bounds.max_examples = len(rt.data.train)
    arrays = strategy.on_task_start(0, to_array_record(rt.model.trainable_state()))
    grid = InProcessGrid(cfg, 3)
    messages = list(strategy.configure_train(1, arrays, ConfigRecord({"task": 0, "round": 0, "attempt": 0}), grid))
    replies = grid.send_and_receive(messages)
    assert not any(r.has_error() for r in replies), [r.error.reason for r in replies if r.has_error()]
    return strategy, messages, replies


def replace_content(reply: Message, content: RecordDict) -> Message:
    out = Message(content=content, reply_to=reply)  # metadata of a reply to the same request
    out.metadata.__dict__.update({k: v for k, v in reply.metadata.__dict__.items() if k != "_message_id"})
    return out


def mutations(content: RecordDict, specs: dict) -> list[tuple[str, RecordDict]]:
    """Every kind of wrong value Flower's records allow, one at a time."""
    out: list[tuple[str, RecordDict]] = []
    kinds = {"array": lambda: ArrayRecord(), "metric": lambda: MetricRecord({"x": 1}),
             "config": lambda: ConfigRecord({"x": "y"})}

    def variant(edit) -> RecordDict:
        c = copy.deepcopy(content)
        edit(c)
        return c

    for name in list(content.keys()):
        if name != PLACEMENT:  # the one optional record
            out.append((f"{name} missing", variant(lambda c, n=name: c.__delitem__(n))))
        for kind, make in kinds.items():
            if type(make()) is type(content[name]) and not content[name]:
                continue  # an empty record of the same kind is the valid reply itself (Powder's alphas, unasked)
            out.append((f"{name} as a {kind} record", variant(lambda c, n=name, m=make: c.__setitem__(n, m()))))
    for kind, make in kinds.items():
        out.append((f"an extra {kind} record", variant(lambda c, m=make: c.__setitem__("extra", m()))))
    wrong_values = [("a list of ints", [1, 2]), ("a list of floats", [1.0]), ("NaN", math.nan), ("inf", math.inf),
                    ("-inf", -math.inf), ("negative", -1), ("a huge int", 10**18)]
    for field in list(content[METRICS].keys()):
        if specs[field].required:  # the method's declared metrics (Fed-CPrompt adds its validation counts)
            out.append((f"metric {field} missing", variant(lambda c, f=field: c[METRICS].__delitem__(f))))
        for label, value in wrong_values:
            if field == "train-loss" and label in ("negative", "a huge int"):
                continue  # a loss may be any finite number
            if field.endswith("seconds") and label == "a huge int":
                continue
            out.append((f"metric {field} {label}",
                        variant(lambda c, f=field, v=value: c[METRICS].__setitem__(f, v))))
        if field == "num-examples":
            out.append(("num-examples as a float", variant(lambda c: c[METRICS].__setitem__("num-examples", 3.5))))
    out.append(("an undeclared metric", variant(lambda c: c[METRICS].__setitem__("bonus", 1.0))))
    out.append(("placement field not a string", variant(lambda c: c[PLACEMENT].__setitem__("node", 5))))
    out.append(("placement unknown field", variant(lambda c: c[PLACEMENT].__setitem__("gpu", "x"))))
    out.append(("placement field far too long", variant(lambda c: c[PLACEMENT].__setitem__("device", "x" * 5000))))
    for name in content[ARRAYS].keys():
        out.append((f"array {name} scaled by 1e30", variant(
            lambda c, n=name: c.__setitem__(ARRAYS, to_array_record(
                {k: v * np.float32(1e30) if k == n else v for k, v in from_array_record(c[ARRAYS]).items()})))))
        break
    for name in content.keys():  # the method's own records: NaN in every array, each in turn
        if name in (ARRAYS, METRICS, PLACEMENT) or name not in content.array_records:
            continue
        for array in content[name].keys():
            arrays = from_array_record(content[name])
            if not np.issubdtype(arrays[array].dtype, np.floating) or arrays[array].size == 0:
                continue
            arrays[array] = np.full_like(arrays[array], np.nan)
            out.append((f"{name}.{array} NaN", variant(lambda c, n=name, a=arrays: c.__setitem__(n, to_array_record(a)))))
    return out


@pytest.mark.parametrize("method", METHODS)
def test_every_wrong_field_is_rejected_with_the_node_and_never_raises(method, flower_identity):
    strategy, messages, replies = one_round(method)
    victim = replies[0]
    good = copy.deepcopy(replies)
    outcome = strategy.aggregate_round(1, good)
    arrays = outcome.arrays
    clean = from_array_record(arrays)
    # what the two good replies alone give (the same for every mutation: computed once)
    alone, _ = strategy.aggregate_train(1, copy.deepcopy(replies[1:]))
    expected = from_array_record(alone)
    for label, content in mutations(victim.content, strategy.reply_metrics):
        bad = [replace_content(victim, content)] + copy.deepcopy(replies[1:])
        try:
            outcome = strategy.aggregate_round(1, bad)
            result = outcome.arrays
        except Exception as exc:  # noqa: BLE001 - the point of the test
            pytest.fail(f"{method}: a reply with {label} raised {type(exc).__name__}: {exc}")
        node = int(messages[0].metadata.dst_node_id)
        assert any(n == node for n, _ in outcome.rejected), f"{method}: a reply with {label} was accepted"
        assert result is not None, f"{method}: {label}: the other replies must still be aggregated"
        # the bad reply took no part: the model is what the two good replies alone give
        for name, value in from_array_record(result).items():
            np.testing.assert_array_equal(value, expected[name], err_msg=f"{method}: {label}")
    assert clean  # the untouched round aggregated


def test_update_norm_outliers_against_the_lower_median():
    from promptfcl.strategies.platform.replies import norm_outliers

    flagged = norm_outliers([1.0, 1.5, 2.0, 1e30, 5e29], 10, 0)  # two hostile replies of five
    assert flagged[:3] == [None, None, None] and all("lower median 2" in f for f in flagged[3:])
    two = norm_outliers([1.0, 50.0], 10, 0)  # of two replies, the larger is the outlier
    assert two[0] is None and "lower median 1" in two[1]
    assert norm_outliers([1.0, 9.0, 3.0], 10, 0) == [None, None, None]  # within the factor: kept
    assert norm_outliers([1.0, 2.0], 0, 1.5) == [None, "update norm 2 above max-update-norm = 1.5"]
    assert norm_outliers([7.0], 10, 0) == [None]


def test_weights_of_unverifiable_counts_are_capped():
    np.testing.assert_allclose(capped_weights([1e12, 10, 10, 10], 0.5), [0.5, 1 / 6, 1 / 6, 1 / 6])
    np.testing.assert_allclose(capped_weights([10, 20, 30], 0.5), [1 / 6, 1 / 3, 1 / 2])  # none above: as is
    np.testing.assert_allclose(capped_weights([90, 5, 5], 0.4), [0.4, 0.3, 0.3])


def test_unknown_namespaces_and_options_are_refused():
    with pytest.raises(ConfigError, match="unknown configuration namespace 'powdr'.*fedavg, fedcprompt"):
        check_namespaces({"powdr.k": 3})
    with pytest.raises(ConfigError, match="unknown option hgp.cov-typo"):
        check_namespaces({"hgp.cov-typo": "diag", "powder.k": 2})  # checked although powder runs
    with pytest.raises(ConfigError, match="takes no options"):
        check_namespaces({"fedavg.lr": 1})
    check_namespaces({"hgp.cov-type": "diag", "powder.k": 2})


# ---------------------------------------------------------------------------- whole runs
def hostile_app(change: Callable[[RecordDict, Message], RecordDict]):
    return client_app([reply_mod(change)])


def set_metric(name: str, value) -> Callable[[RecordDict, Message], RecordDict]:
    def change(content: RecordDict, _: Message) -> RecordDict:
        content[METRICS][name] = value
        return content
    return change


def delete_metric(name: str) -> Callable[[RecordDict, Message], RecordDict]:
    def change(content: RecordDict, _: Message) -> RecordDict:
        del content[METRICS][name]
        return content
    return change


def scale_arrays(content: RecordDict, _: Message) -> RecordDict:
    content[ARRAYS] = to_array_record({k: v * np.float32(1e30) for k, v in from_array_record(content[ARRAYS]).items()})
    return content


def failing(msg: Message, context, call_next):
    raise RuntimeError("this node fails every message")


HOSTILE = {
    "train-loss missing": delete_metric("train-loss"),
    "train-loss a list": set_metric("train-loss", [0.5, 0.5]),
    "train-seconds a list": set_metric("train-seconds", [1.0]),
    "train-loss NaN": set_metric("train-loss", math.nan),
    "an absurd count": set_metric("num-examples", 10**12),
    "arrays times 1e30": scale_arrays,
}


@pytest.fixture(scope="module")
def baseline_without_node(tmp_path_factory):
    """The run in which the third node fails every message: what a run must equal when that node's
    replies are all excluded."""
    from tests.conftest import flower_task_identity

    with flower_task_identity():
        cfg = method_config("fedavg", defences="on", **{"out-dir": str(tmp_path_factory.mktemp("failing"))})
        from flwr.clientapp import ClientApp

        dead = ClientApp(mods=[failing])
        return run_in_process(cfg, nodes=3, apps={1003: dead})


@pytest.mark.e2e
@pytest.mark.parametrize("label", sorted(HOSTILE))
def test_a_hostile_node_is_excluded_and_the_run_completes(label, baseline_without_node, tmp_path, flower_identity):
    # defended, as a run facing a hostile node is: a finite but huge update is the norm filter's
    cfg = method_config("fedavg", defences="on", **{"out-dir": str(tmp_path)})
    results = run_in_process(cfg, nodes=3, apps={1003: hostile_app(HOSTILE[label])})
    rejected = [r for rnd in results["rounds"] for r in rnd["rejected"]]
    assert rejected and {r["node"] for r in rejected} == {1003}, rejected
    assert all(rnd["clients_aggregated"] == 2 for rnd in results["rounds"])
    # exactly the run in which that node failed every message: its replies took no part
    assert results["accuracy_matrix"] == baseline_without_node["accuracy_matrix"]
    written = json.loads((tmp_path / "results.json").read_text())
    assert written["accuracy_matrix"] == results["accuracy_matrix"]


def test_bad_hgp_statistics_exclude_the_whole_reply(flower_identity):
    """HGP checks its class statistics as FPPL and Powder check theirs: a bad record excludes the
    reply (prompts and head included), with the node in ``rejected``."""
    from promptfcl.strategies.hgp.strategy import STATS

    strategy, messages, replies = one_round("hgp")
    stats = from_array_record(replies[0].content[STATS])

    def with_stats(**changes) -> RecordDict:
        content = copy.deepcopy(replies[0].content)
        content[STATS] = to_array_record({**stats, **changes})
        return content

    bad = {
        "a class outside the task": with_stats(classes=stats["classes"] + 5),
        "counts that are not the samples": with_stats(counts=stats["counts"] * 2),
        "means no feature can have": with_stats(means=stats["means"] * np.float32(1e9)),
        "another covariance encoding": with_stats(**{"cov-diag": np.ones_like(stats["means"])}),
    }
    for label, content in bad.items():
        outcome = strategy.aggregate_round(1, [replace_content(replies[0], content)] + copy.deepcopy(replies[1:]))
        node = int(messages[0].metadata.dst_node_id)
        assert [n for n, _ in outcome.rejected] == [node], label


@pytest.mark.e2e
@pytest.mark.parametrize("how", ["silent", "lost"])
def test_a_dead_node_is_named_by_its_own_id(how, tmp_path, flower_identity):
    # a silent node is waited for until round-timeout, as by Flower's grid
    results = run_in_process(method_config("fedavg", **{"out-dir": str(tmp_path), "round-timeout": 0.5}), nodes=3,
                             dead={1002: how})
    for rnd in results["rounds"]:
        assert [r["node"] for r in rnd["rejected"]] == [1002]
        assert ("round-timeout" if how == "silent" else "node lost") in rnd["rejected"][0]["reason"]


@pytest.mark.e2e
def test_a_run_with_nan_metrics_is_written_and_resumed(tmp_path, flower_identity):
    """A node sends NaN losses; the run stops after 2 rounds (its checkpoint kept), results are
    written, and the resumed run ends where the uninterrupted one does."""
    hostile = {1003: hostile_app(HOSTILE["train-loss NaN"])}
    rounds = {"rounds-per-task": 2}
    whole = run_in_process(method_config("fedavg", **rounds, **{"out-dir": str(tmp_path / "whole")}), nodes=3,
                           apps=hostile)
    out = tmp_path / "stopped"
    first = run_in_process(method_config("fedavg", **rounds, **{"out-dir": str(out), "max-rounds": 2}), nodes=3,
                           apps=hostile)
    assert first["stopped_after_round"] == 2 and (out / "results.json").is_file()
    assert json.loads((out / "results.json").read_text())["accuracy_matrix"][0][0] is not None  # task 1 finished
    resumed = run_in_process(method_config("fedavg", **rounds, **{"out-dir": str(out), "resume": True}), nodes=3,
                             apps=hostile)
    assert resumed["accuracy_matrix"] == whole["accuracy_matrix"]
    assert [r["server_round"] for r in resumed["rounds"]] == [1, 2, 3, 4]


def test_non_finite_values_are_written_as_null_and_counted(tmp_path):
    from promptfcl.common.config.experiment import ExperimentConfig
    from promptfcl.server.report import write_outputs

    results = {"config": ExperimentConfig().to_dict(), "accuracy_matrix": [[50.0]],
               "average_accuracy_per_task": [50.0],
               "rounds": [{"server_round": 1, "task": 0, "round": 0, "accuracy": 50.0, "task_accuracies": [50.0],
                           "train_loss": float("nan"), "odd": [np.float32("inf"), np.int64(3)]}],
               "final_average_accuracy": 50.0, "average_incremental_accuracy": 50.0, "average_forgetting": 0.0,
               "communication": {"bytes_s2c_per_round": 1, "bytes_c2s_per_round": 1, "trainable_parameters": 1},
               "timing": {"client_seconds_per_round": 0.1, "server_seconds_per_round": 0.1, "total_seconds": 1.0}}
    write_outputs(results, tmp_path)  # the table and plots too: a non-finite loss must not break them
    assert (tmp_path / "table.md").read_text().strip()
    written = json.loads((tmp_path / "results.json").read_text())
    assert written["rounds"][0]["train_loss"] is None and written["rounds"][0]["odd"] == [None, 3]
    assert written["rounds"][0]["non_finite_values"] == 2 and written["non_finite_values"] == 2


# ---------------------------------------------------------------------------- before Ray starts
@pytest.mark.simulation
def test_data_problems_stop_the_run_before_ray_starts_and_name_the_file(tmp_path):
    import subprocess
    import sys

    from tests.test_data import _write_idx

    data = tmp_path / "fmnist"
    data.mkdir()
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 40), ("t10k", 20)):
        _write_idx(data / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 255, (n, 28, 28)))
        _write_idx(data / f"{prefix}-labels-idx1-ubyte.gz", np.arange(n) % 10)
    images = data / "train-images-idx3-ubyte.gz"
    images.write_bytes(images.read_bytes()[:200])  # an interrupted copy
    base = [sys.executable, "-m", "promptfcl.server.cli", "simulate", "--out", str(tmp_path / "run"), "--set", 'weights="random"']
    for extra, expected in (
        (["--set", 'dataset="fashion-mnist"', "--set", f'data-dir="{data}"'],
         [str(images), "truncated gzip (EOFError", "re-install"]),
        (["--set", "num-tasks=7", "--set", "pool-size=21"], ["10 classes, not divisible into num-tasks = 7"]),
    ):
        proc = subprocess.run(base + extra, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert all(e in proc.stderr for e in expected), proc.stderr[-2000:]
        assert "Flower simulation" not in proc.stderr + proc.stdout  # Ray was never started


@pytest.mark.parametrize("kind, factor, expected", [("poison", 10.0, -10.0), ("sign-flip", 10.0, -1.0),
                                                     ("poison-under-filter", 10.0, -9.0),
                                                     ("poison-under-filter", 4.0, -3.6)])
def test_reversing_attacks_reverse_the_update_at_their_scale(kind, factor, expected):
    from flwr.app import MetricRecord, RecordDict

    from promptfcl.client.faults import corrupt
    from promptfcl.common.records import ARRAYS, METRICS, from_array_record, to_array_record

    sent = {"w": np.full(4, 2.0, np.float32)}
    reply = RecordDict({ARRAYS: to_array_record({"w": np.full(4, 3.0, np.float32)}),  # update +1
                        METRICS: MetricRecord({"num-examples": 5})})
    out = from_array_record(corrupt(kind, reply, sent, factor)[ARRAYS])["w"]
    np.testing.assert_allclose(out, 2.0 + expected)
    assert out.dtype == np.float32


def test_reversing_attacks_reverse_a_returned_row_against_the_row_it_was_sent():
    """FPPL returns only its task's prompt row: the attack reverses that row's own update (the
    same norm as an honest update for sign-flip), not the whole value."""
    from flwr.app import MetricRecord, RecordDict

    from promptfcl.client.faults import corrupt
    from promptfcl.common.records import ARRAYS, METRICS, from_array_record, to_array_record

    sent = {"prompt.p0": np.stack([np.full((2, 3), 10.0 * t, np.float32) for t in range(4)])}  # (4, 2, 3)
    trained_row = np.full((1, 2, 3), 20.5, np.float32)  # task 2's row, moved by +0.5
    reply = RecordDict({ARRAYS: to_array_record({"prompt.p0": trained_row}), METRICS: MetricRecord({"num-examples": 5})})
    out = from_array_record(corrupt("sign-flip", reply, sent)[ARRAYS])["prompt.p0"]
    np.testing.assert_allclose(out, 19.5)  # 20 - 0.5: the update reversed, not the value negated
    out = from_array_record(corrupt("poison", reply, sent)[ARRAYS])["prompt.p0"]
    np.testing.assert_allclose(out, 15.0)


def test_statistics_attacks_forge_well_formed_records():
    from flwr.app import MetricRecord, RecordDict

    from promptfcl.client.faults import corrupt
    from promptfcl.common.records import ARRAYS, METRICS, from_array_record, to_array_record
    from promptfcl.strategies.platform.statistics import Statistics

    stats = {"classes": np.array([2, 3]), "counts": np.array([30, 10]), "means": np.ones((2, 4), np.float32),
             "cov-diag": np.full((2, 4), 0.5, np.float32)}
    reply = RecordDict({ARRAYS: to_array_record({"w": np.zeros(3, np.float32)}),
                        "class-stats": to_array_record(stats), METRICS: MetricRecord({"num-examples": 40})})

    spec = {"class-stats": Statistics(vectors=("means",), counts=("counts",), second_moments={"cov-diag": "diagonal"})}

    def forged(kind):
        out = corrupt(kind, reply, {"w": np.zeros(3, np.float32)}, specs=spec)
        assert np.array_equal(from_array_record(out[ARRAYS])["w"], np.zeros(3))  # the model is left alone
        return from_array_record(out["class-stats"])

    np.testing.assert_allclose(forged("stats-scale")["means"], 20.0)
    np.testing.assert_allclose(forged("stats-shift")["means"], 6.0)
    np.testing.assert_allclose(forged("cov-inflate")["cov-diag"], 50.0)
    hist = forged("hist-forge")
    assert hist["counts"].tolist() == [40, 0] and hist["classes"].tolist() == [2, 3]  # same total, one class


def test_statistics_attacks_forge_what_each_method_declares():
    """The attacks follow each method's declaration (``statistics``, read on the client from the
    registry), as the platform's bound does: LoRM's Gram diagonals and head Gram are second
    moments (cov-inflate x 100), C2Prompt's variances too; an array the method does not declare
    (LoRM's block ids and token count, C2Prompt's histogram) is never touched."""
    from flwr.app import MetricRecord, RecordDict

    from promptfcl.client.faults import corrupt
    from promptfcl.common.records import ARRAYS, METRICS, from_array_record, to_array_record
    from promptfcl.strategies.registry import statistics_of, strategy_class

    grams = {"blocks": np.array([0, 1]), "samples": np.array([40]), "tokens": np.array([2000]),
             "head-gram": np.full((1, 6), 0.5, np.float32),
             **{f"diag-{t}": np.full((2, 4), 0.25, np.float32) for t in ("qkv", "proj", "fc1", "fc2")}}
    reply = RecordDict({ARRAYS: to_array_record({"w": np.zeros(3, np.float32)}), "lorm-grams": to_array_record(grams),
                        METRICS: MetricRecord({"num-examples": 40})})
    assert statistics_of("lorm") == strategy_class("lorm").statistics
    out = from_array_record(corrupt("cov-inflate", reply, {}, specs=statistics_of("lorm"))["lorm-grams"])
    for t in ("qkv", "proj", "fc1", "fc2"):
        np.testing.assert_allclose(out[f"diag-{t}"], 25.0)
    np.testing.assert_allclose(out["head-gram"], 50.0)
    assert out["blocks"].tolist() == [0, 1] and out["tokens"].tolist() == [2000] and out["samples"].tolist() == [40]
    hist = {"hist": np.ones((2, 3), np.float32)}
    stats = {"classes": np.array([2, 3]), "counts": np.array([30, 10]), "means": np.ones((2, 4), np.float32),
             "var": np.full((2, 4), 0.5, np.float32)}
    reply = RecordDict({"c2prompt-hist": to_array_record(hist), "c2prompt-stats": to_array_record(stats),
                        METRICS: MetricRecord({"num-examples": 40})})
    out = corrupt("cov-inflate", reply, {}, specs=statistics_of("c2prompt"))
    np.testing.assert_allclose(from_array_record(out["c2prompt-stats"])["var"], 50.0)
    np.testing.assert_allclose(from_array_record(out["c2prompt-hist"])["hist"], 1.0)


def test_statistics_attacks_reach_an_exchange_answer_that_carries_no_model(flower_identity):
    """Powder measures its alphas in an exchange before training (a query message, no model in
    the answer): the statistics attacks forge those too; model attacks leave a query alone."""
    from flwr.app import ConfigRecord as Config
    from flwr.app import Context, Message, MessageType, MetricRecord, RecordDict

    from promptfcl.client.faults import inject_faults
    from promptfcl.common.records import CONFIG, METRICS, from_array_record, to_array_record

    alphas = {"tasks": np.array([1]), "task-alpha": np.full((1, 6), 0.25, np.float32), "task-count": np.array([40])}

    def answer(msg, context):
        return Message(RecordDict({"powder-alpha": to_array_record(alphas),
                                   METRICS: MetricRecord({"num-examples": 40})}), reply_to=msg)

    def sent(fault):
        query = Message(RecordDict({CONFIG: Config({"client-id": 0, "task": 1, "round": 0})}), dst_node_id=1,
                        message_type=MessageType.QUERY)
        context = Context(run_id=1, node_id=1, node_config={"fault-injection": True}, state=RecordDict(),
                          run_config={"strategy": "powder", "fault": fault, "fault-clients": "0"})
        return from_array_record(inject_faults(query, context, answer).content["powder-alpha"])

    np.testing.assert_allclose(sent("stats-scale")["task-alpha"], 5.0)
    np.testing.assert_allclose(sent("stats-shift")["task-alpha"], 5.25)
    np.testing.assert_allclose(sent("sign-flip")["task-alpha"], 0.25)  # a model attack: nothing to reverse here
