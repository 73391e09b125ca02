"""Edge nodes: a memory budget keeps the updates, its plan, lower-precision backbones, the shared backbone."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from torch import nn

from promptfcl.client.memory import apply_plan, step_sizes
from promptfcl.client.message_context import MessageContext
from promptfcl.client.node_policy import NodePolicy, NodeRefusal
from promptfcl.common.model import prompted as model_module
from promptfcl.common.model.backbone import backbone_cache_path, build_backbone
from promptfcl.common.model.low_precision import Bf16Linear, Int8Linear, lower_precision
from promptfcl.common.model.runtime import backbone_of, get_runtime
from promptfcl.common.node.memory_plan import (
    MARGIN_MB,
    BudgetError,
    StepSizes,
    TrainingPlan,
    mapped_mb,
    plan_training,
    resident_mb,
)
from promptfcl.common.records import ARRAYS, CONFIG, from_array_record, to_array_record
from promptfcl.strategies.fedavg.strategy import FedAvgStrategy
from promptfcl.strategies.fppl.learner import FPPLLearner
from promptfcl.strategies.fppl.prompt import FPPLPrompt
from promptfcl.strategies.fppl.records import GLOBAL_PROTOTYPES
from promptfcl.strategies.fppl.strategy import FPPLStrategy
from promptfcl.strategies.platform.learner import FitConditions, LocalLearner
from tests.conftest import tiny_config

#: a budgeted step differs from the whole batch's only by float rounding (micro-batch sums)
ATOL = 2e-5


def budgeted(model: Any, micro: int, checkpointed: int) -> FitConditions:
    """A fit's plan of ``micro``-image micro-batches, the first ``checkpointed`` blocks of ``model`` recomputed."""
    model.checkpointed = frozenset(range(checkpointed))
    return FitConditions(TrainingPlan(1000.0, micro, checkpointed))


def assert_same_upload(a: RecordDict, b: RecordDict) -> None:
    first, second = from_array_record(a[ARRAYS]), from_array_record(b[ARRAYS])
    assert first.keys() == second.keys()
    for name in first:
        np.testing.assert_allclose(first[name], second[name], rtol=0, atol=ATOL, err_msg=name)


@pytest.fixture
def count_checkpoints(monkeypatch):
    calls = []
    real = model_module.checkpoint

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(model_module, "checkpoint", counting)
    return calls


def test_a_budgeted_round_uploads_the_arrays_of_the_unbudgeted_one(count_checkpoints):
    cfg = tiny_config(num_tasks=2, centralised=True, lr=0.01, local_epochs=2, batch_size=32)
    rt = get_runtime(cfg)
    s = FedAvgStrategy.of(cfg, rt.data.num_classes)
    arrays = s.on_task_start(0, to_array_record(rt.model.trainable_state()))
    content = RecordDict({ARRAYS: arrays})
    whole = LocalLearner.of(cfg, rt).fit(content, 0, 0, 0)
    assert not count_checkpoints
    try:
        micro = LocalLearner.of(cfg, rt).fit(content, 0, 0, 0, budgeted(rt.model, 5, 2))
        plain_micro = LocalLearner.of(cfg, rt).fit(content, 0, 0, 0, budgeted(rt.model, 7, 0))
    finally:
        rt.model.checkpointed = frozenset()
    assert count_checkpoints  # the blocks were recomputed, not kept
    assert_same_upload(whole, micro)
    assert_same_upload(whole, plain_micro)
    assert micro["metrics"]["train-loss"] == pytest.approx(whole["metrics"]["train-loss"], rel=1e-5)
    # and training moved the arrays far more than the tolerance: the comparison means something
    sent, trained = from_array_record(arrays), from_array_record(whole[ARRAYS])
    assert max(np.abs(trained[n] - sent[n]).max() for n in sent) > 100 * ATOL


def test_fppl_micro_batches_average_over_the_steps_samples_with_a_prototype():
    cfg = tiny_config(strategy="fppl", num_tasks=2, centralised=True, lr=0.01, batch_size=32,
                      prompt_mode="prompt", pool_size=2)
    rt = get_runtime(cfg, FPPLPrompt)
    s = FPPLStrategy.of(cfg, rt.data.num_classes)
    arrays = s.on_task_start(1, s.on_task_start(0, to_array_record(rt.model.trainable_state())))
    # prototypes of 3 of task 1's 5 classes: the samples of the other two have none
    rng = np.random.default_rng(0)
    protos = ArrayRecord({"classes": Array(np.array([5, 6, 7])),
                          "means": Array(rng.normal(size=(3, cfg.model.embed_dim)).astype(np.float32))})
    content = RecordDict({ARRAYS: arrays, CONFIG: ConfigRecord({"client-id": 0}), GLOBAL_PROTOTYPES: protos})
    whole = FPPLLearner.of(cfg, rt).fit(content, 1, 0, 0)
    try:
        micro = FPPLLearner.of(cfg, rt).fit(content, 1, 0, 0, budgeted(rt.model, 3, 1))
    finally:
        rt.model.checkpointed = frozenset()
    assert_same_upload(whole, micro)


def test_powder_dual_distillation_weights_the_steps_samples_not_the_micro_batchs(flower_identity):
    from tests.test_powder import client_setup, message_for

    cfg, rt, s, arrays = client_setup()
    s.task_measured[:] = True
    msg = message_for(s, arrays, 1, 1)  # a round with a teacher: dual distillation on
    from promptfcl.strategies.powder.learner import PowderLearner

    whole = PowderLearner.of(cfg, rt, {}).fit(msg.content, 1, 1, 0)
    try:
        learner = PowderLearner.of(cfg, rt, {})
        micro = learner.fit(msg.content, 1, 1, 0, budgeted(rt.model, 4, 2))
    finally:
        rt.model.checkpointed = frozenset()
    assert learner.last_distillation is not None
    assert_same_upload(whole, micro)


# ---------------------------------------------------------------------------- the plan
VIT_B = StepSizes(batch=64, tokens=197, width=768, graded_blocks=12, blocks=12, input_floats=3 * 224 * 224)


def test_the_plan_keeps_whole_batches_where_they_fit_and_recomputes_only_where_it_must():
    roomy = plan_training(64_000, VIT_B, held_mb=900)
    assert (roomy.micro_batch, roomy.checkpointed) == (64, 0)
    middle = plan_training(3000, VIT_B, held_mb=900)
    assert middle.checkpointed == 0 and 1 < middle.micro_batch < 64
    tight = plan_training(1430, VIT_B, held_mb=900)  # not one image with every activation kept
    assert 0 < tight.checkpointed <= 12 and tight.micro_batch >= 1
    assert plan_training(1460, VIT_B, held_mb=900).checkpointed < tight.checkpointed  # more room, less recomputed
    gpu = plan_training(1830, VIT_B, held_mb=900, min_micro=8)  # a GPU recomputes rather than idle on 1 image
    assert gpu.micro_batch >= 8 and gpu.checkpointed > 0
    # what it plans fits: held + margin + inputs + micro-batch x per image <= budget
    for plan, budget in ((middle, 3000), (tight, 1430), (gpu, 1830)):
        used = 900 + MARGIN_MB + VIT_B.inputs_mb() + plan.micro_batch * VIT_B.per_image_mb(plan.checkpointed)
        assert used <= budget
        assert (plan.micro_batch + 1) * VIT_B.per_image_mb(plan.checkpointed) + 900 + MARGIN_MB + VIT_B.inputs_mb() > budget
    assert plan_training(0, VIT_B, held_mb=900) == TrainingPlan(held_mb=900)  # no budget: the defaults


def test_a_budget_too_small_for_one_image_names_the_setting():
    with pytest.raises(BudgetError, match="memory-budget-mb = 1000 .*needs at least"):
        plan_training(1000, VIT_B, held_mb=900)


def test_node_config_keys_are_checked_and_a_refusal_names_them():
    policy = NodePolicy.from_node_config({"memory-budget-mb": 1500, "backbone-precision": "int8"})
    assert (policy.memory_budget_mb, policy.precision) == (1500.0, "int8")
    with pytest.raises(NodeRefusal, match="memory-budget-mb"):
        NodePolicy.from_node_config({"memory-budget-mb": "lots"})
    with pytest.raises(NodeRefusal, match="backbone-precision"):
        NodePolicy.from_node_config({"backbone-precision": "fp8"})
    cfg = tiny_config()
    rt = get_runtime(cfg)
    with pytest.raises(NodeRefusal, match="memory-budget-mb"):
        apply_plan(MessageContext.of(cfg, {"memory-budget-mb": 10}), rt)
    plan = apply_plan(MessageContext.of(cfg, {"memory-budget-mb": resident_mb() + 4000}), rt)
    assert plan.micro_batch == cfg.training.batch_size and not rt.model.checkpointed
    apply_plan(MessageContext.of(cfg, {}), rt)
    assert rt.model.max_batch == 0  # no budget: nothing of another node's plan stays


def test_a_round_that_passes_its_budget_says_so_in_its_plan_record_and_the_log(caplog):
    from promptfcl.client.memory import plan_metrics

    rt = get_runtime(tiny_config())
    within = plan_metrics(TrainingPlan(budget_mb=resident_mb() + 4000), rt)
    assert "over-budget-mb" not in within and within["peak-rss-mb"] > 0
    with caplog.at_level("WARNING", logger="promptfcl"):
        passed = plan_metrics(TrainingPlan(budget_mb=50.0, micro_batch=1), rt)  # the process alone is more
    assert passed["over-budget-mb"] == pytest.approx(passed["peak-rss-mb"] - 50.0)
    assert "above memory-budget-mb = 50" in caplog.text


def test_the_plan_counts_what_the_round_adds_after_it():
    after = 500.0  # gradients, Adam's moments, the reply: the activations get what is left
    roomy = plan_training(3000, VIT_B, held_mb=900)
    planned = plan_training(3000, VIT_B, held_mb=900, after_mb=after)
    assert planned.micro_batch < roomy.micro_batch
    used = 900 + after + MARGIN_MB + VIT_B.inputs_mb() + planned.micro_batch * VIT_B.per_image_mb(planned.checkpointed)
    assert used <= 3000
    with pytest.raises(BudgetError, match="memory-budget-mb = 1500 .*the round adds 500 MB"):
        plan_training(1500, VIT_B, held_mb=900, after_mb=after)


def test_step_sizes_read_the_model():
    rt = get_runtime(tiny_config(prompt_layers="1"))
    sizes = step_sizes(rt.model, 32)
    assert (sizes.tokens, sizes.width, sizes.graded_blocks, sizes.blocks) == (17, 48, 1, 2)


# ---------------------------------------------------------------------------- precision and sharing
@pytest.mark.parametrize("kind, tolerance", [(Int8Linear, 0.05), (Bf16Linear, 0.01)])
def test_lower_precision_linear_is_close_to_the_float_layer_and_differentiable_in_its_input(kind, tolerance):
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    q = kind(linear)
    x = torch.randn(3, 5, 64, requires_grad=True)
    y = q(x)
    assert y.shape == (3, 5, 32) and y.dtype == torch.float32
    reference = linear(x)
    assert 0 < (y - reference).abs().max() < tolerance * reference.abs().max()  # rounded, not the same
    y.sum().backward()
    expected = linear.weight.sum(0).expand(3, 5, 64)
    assert (x.grad - expected).abs().max() < tolerance * expected.abs().max()


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_a_lower_precision_backbone_trains_near_the_float_one(precision):
    cfg = tiny_config(num_tasks=2, centralised=True, lr=0.01)
    fp32 = get_runtime(cfg)
    low = get_runtime(cfg, precision=precision)
    assert low.model is not fp32.model and low.precision == precision
    assert not low.mixed_precision  # float32 arithmetic on the lower-precision weights
    kinds = {type(m).__name__ for m in low.model.backbone.modules()}
    assert {"Int8Linear": "int8", "Bf16Linear": "bf16"}.keys() & kinds == {f"{precision.title()}Linear"}
    assert "Linear" not in kinds  # every frozen linear layer converted
    s = FedAvgStrategy.of(cfg, fp32.data.num_classes)
    arrays = s.on_task_start(0, to_array_record(fp32.model.trainable_state()))
    a = from_array_record(LocalLearner.of(cfg, fp32).fit(RecordDict({ARRAYS: arrays}), 0, 0, 0)[ARRAYS])
    b = from_array_record(LocalLearner.of(cfg, low).fit(RecordDict({ARRAYS: arrays}), 0, 0, 0)[ARRAYS])
    sent = from_array_record(arrays)
    # not the same update, but the same direction: the head's change agrees in cosine
    da, db = (a["head.weight"] - sent["head.weight"]).ravel(), (b["head.weight"] - sent["head.weight"]).ravel()
    assert np.dot(da, db) / (np.linalg.norm(da) * np.linalg.norm(db)) > 0.8


def test_the_backbone_is_read_through_a_shared_mapping_of_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMPTFCL_CACHE", str(tmp_path))
    cfg = tiny_config(backbone_cache_disk="on", embed_dim=96, depth=2, image_size=32)
    build_backbone(backbone_of(cfg))  # a miss: built and written
    path = backbone_cache_path(backbone_of(cfg))
    assert path is not None and path.is_file()
    backbone, _ = build_backbone(backbone_of(cfg))  # read from the cache: mapped, not copied
    with torch.no_grad():
        backbone(torch.zeros(1, 3, 32, 32))  # touch every weight
    before = mapped_mb(path)
    assert before > 0.5 * path.stat().st_size / 1e6
    weight = backbone.blocks[0].mlp.fc1.weight
    assert weight.untyped_storage().nbytes() < path.stat().st_size  # a view into the file, not the file read
    lower_precision(backbone, "int8", str(path))
    assert mapped_mb(path) < 0.5 * before  # the float weights' pages handed back as they were replaced
    with torch.no_grad():
        assert torch.isfinite(backbone(torch.zeros(1, 3, 32, 32))).all()


def test_results_record_each_budgeted_nodes_plan_and_refuse_a_starved_node(tmp_path, flower_identity):
    from tests.helpers import run_in_process

    cfg = tiny_config(out_dir=str(tmp_path), num_tasks=1, rounds_per_task=1, num_clients=3, clients_per_round=3,
                      min_replies=1)
    budget = resident_mb() + 4000
    results = run_in_process(cfg, nodes=3, node_configs={1001: {"memory-budget-mb": budget},
                                                           1002: {"memory-budget-mb": 10}})
    (record,) = results["rounds"]
    (plan,) = record["memory_plans"]  # node 1003 has no budget: nothing to report
    assert plan["node"] == 1001 and plan["memory-budget-mb"] == pytest.approx(budget)
    assert plan["micro-batch"] == cfg.training.batch_size and plan["checkpointed-blocks"] == 0 and plan["backbone-bits"] == 32
    assert 0 < plan["peak-rss-mb"]
    assert record["clients_aggregated"] == 2
    (refused,) = record["rejected"]
    assert refused["node"] == 1002 and "memory-budget-mb = 10 is too small" in refused["reason"]


def test_bench_edge_compares_each_row_with_the_float32_round_of_its_batch(tmp_path, monkeypatch):
    import json

    from promptfcl.server.bench import edge as bench_edge

    offsets = {"fp32": 0.0, "fp32-1500": 1e-6, "int8-1500": 2e-3}

    def fake_row(name, precision, budget_mb, batch_size, threads, out_dir):
        path = out_dir / f"{name}.npz"
        np.savez(path, w=np.full(3, 0.5 + offsets[name]))
        return {"name": name, "precision": precision, "budget_mb": budget_mb, "arrays": path, "peak-rss-mb": 1.0,
                "images_per_second": 1.0, "cpu_seconds_per_image": 1.0, "micro-batch": 1, "checkpointed-blocks": 0,
                "backbone-mapped-mb": 0.0}

    monkeypatch.setattr(bench_edge, "prepare_cache", lambda *a: None)
    monkeypatch.setattr(bench_edge, "run_row", fake_row)
    bench_edge.edge_rounds(tmp_path, 8, 1, [("fp32", "fp32", 0.0, 0), ("fp32-1500", "fp32", 1500.0, 0)])
    bench_edge.edge_rounds(tmp_path, 8, 1, [("int8-1500", "int8", 1500.0, 0)])  # a later invocation keeps the rows
    rows = {r["name"]: r for r in json.loads((tmp_path / "edge.json").read_text())["rows"]}
    assert set(rows) == set(offsets)
    for name, offset in offsets.items():
        assert rows[name]["max_abs_update_diff"] == pytest.approx(offset, abs=1e-12)
        assert rows[name]["batch_size"] == 8
