"""The ClientApp: local training on the task and client share the server assigns,
and (federated evaluation) per-task correct/total counts of the global model.

A message may start a fresh process (deployment) or reuse a long-lived one (Ray
simulation); the runtime (data, backbone, query cache) is cached per process and
configuration, so reuse is free and a fresh start rebuilds only what it must: the
backbone weights come from the node's disk cache, and so do the queries
(``query-cache-disk``) and decoded image folders (``client/node_data.py``).

Two populations (run-config ``population``):

* ``virtual``: the server says which client this node plays (``client-id``) and every
  node holds the run's whole dataset (simulation; a deployed node only with ``data-from-run``).
* ``nodes``: this node *is* a client with its own data, given by its node config
  (``data-dir``, ``dataset``, or ``partition-id``/``num-partitions``); see client/node_data.py.

An exception on the node reaches the server as an error reply; :func:`report_errors` makes its
text say what failed without the node's local paths (the whole exception stays in the node's log).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from ..common.model.evaluation import correct_counts, pooled_counts
from ..common.model.runtime import Runtime, get_runtime
from ..common.model.weights import cache_dir
from ..common.node import startup
from ..common.node.memory_plan import TrainingPlan
from ..common.privacy import PrivacyOptions, privatise_reply
from ..common.records import (
    ARRAYS,
    EVALUATE_TASK,
    EVALUATION,
    METRICS,
    PLACEMENT,
    POOL_PREFIX,
    arrays_of,
    as_int,
    config_of,
    metrics_of,
    to_torch,
)
from ..common.text import escape_log_args, printable, without_paths
from ..strategies.platform.learner import FitConditions, read_task_round
from ..strategies.platform.run_checks import check_client_run
from ..strategies.registry import learner_class, private_records, prompt_class
from .faults import flips_labels, inject_faults
from .memory import apply_plan, plan_metrics
from .message_context import MessageContext, message_context, message_context_mod
from .node_data import NodeDataError, check_classes, node_data, original_names
from .node_policy import WEIGHTS, NodeRefusal, in_ray_actor, simulated_nodes_mod

# what the node logs of the run config and the server's messages cannot forge log lines
log = escape_log_args()

#: the longest error text a node sends the server
REASON_LIMIT = 1000


class NodeError(RuntimeError):
    """What the server is told of an exception on this node: its type and message, without the
    node's local paths (raised from the original, which the node's own log shows in full)."""


def report_errors(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """Flower mod: an exception in the ClientApp leaves it as a :class:`NodeError` whose text
    names the error without local paths; Flower turns that into the error reply the server sees."""
    try:
        return call_next(msg, context)
    except Exception as exc:
        raise NodeError(public_reason(exc, context.node_config)) from exc


def public_reason(exc: BaseException, node_config: Mapping[str, Any]) -> str:
    """``"<type>: <message>"`` with the node's folders named (``<data-dir>``, ``<weights>``,
    ``<cache>``), any other absolute path replaced by ``<path>``, control characters escaped."""
    known: dict[str, str] = {}
    dataset = node_config.get("dataset")
    named = [(node_config.get("data-dir"), "<data-dir>"), (node_config.get(WEIGHTS), "<weights>"),
             (dataset[len("folder:"):] if isinstance(dataset, str) and dataset.startswith("folder:") else None,
              "<data-dir>"), (str(cache_dir()), "<cache>")]
    for value, name in named:
        if isinstance(value, str) and value and value not in ("timm", "random") and not value.startswith("pretrained:"):
            full = os.path.expanduser(value)
            for form in (value, full, os.path.abspath(full), os.path.realpath(full)):
                known[form] = name
    return printable(f"{type(exc).__name__}: {without_paths(str(exc), known)}", REASON_LIMIT)


# the outermost mod, so nothing the others raise reaches Flower unfiltered; simulated nodes (Ray
# actors) are their operator's (client/node_policy.py); seeded fault injection (run-config `fault`)
# runs only on nodes that enable it; the message's context is parsed once, after the mod that may
# switch on a simulated node's options and before the mods and functions that read it
app = ClientApp(mods=[report_errors, simulated_nodes_mod, message_context_mod, inject_faults])


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Load the global prompts and head, train on this client's share, reply the update."""
    node = message_context(context)
    cfg = node.cfg
    config = config_of(msg.content)
    check_same_config(node.digest, config)
    started = time.perf_counter()
    runtime, client_id = client_runtime(node, config)
    setup = time.perf_counter() - started
    with startup.phase("context"):
        learner = learner_class(cfg.run.strategy).of(cfg, runtime, node.options, node.privacy)
        plan = apply_plan(node, runtime)  # the node's memory budget, before anything big runs
    # evaluate-with-train: the received model's counts, before training changes it
    evaluated = time.perf_counter()
    own_data = cfg.federation.population == "nodes"
    evaluation = evaluate_received(runtime, msg.content, cfg.data.num_tasks,
                                   own_data) if EVALUATE_TASK in config else None
    evaluation_seconds = time.perf_counter() - evaluated
    task, round_, client_id = assignment(config, client_id, cfg.federation.population, cfg.data.task_generator,
                                         cfg.federation.num_clients)
    reply = learner.fit(msg.content, task, round_, client_id,
                        FitConditions(plan, flips_labels(cfg, node.policy, client_id, task, round_)))
    with startup.phase("reply"):  # the reply as it leaves: privatised, its metrics, where it was trained
        reply = finish_reply(reply, learner.update_reference(msg.content[ARRAYS], task), node, runtime, plan)
        if METRICS in reply.metric_records:  # the cost of this message's process (deployment overhead)
            metrics = metrics_of(reply)
            metrics["setup-seconds"] = setup
            if evaluation is not None:  # not start-up: the server subtracts it from the process's overhead
                metrics["evaluation-seconds"] = evaluation_seconds
        reply[PLACEMENT] = placement(runtime, context, node.digest)
        if evaluation is not None:
            reply[EVALUATION] = evaluation
    if METRICS in reply.metric_records:
        report_process_cost(metrics_of(reply))
    return Message(content=reply, reply_to=msg)


def finish_reply(reply: RecordDict, reference: ArrayRecord, node: MessageContext, runtime: Runtime,
                 plan: TrainingPlan) -> RecordDict:
    """A fit's ``reply`` as it may leave this node: with ``dp.*`` on, the run checked and the upload
    privatised (``reference``: what the update is of); the node's declared sizes and, with a
    memory budget or its own backbone precision, what it chose (``plan``)."""
    cfg = node.cfg
    if node.privacy.enabled:
        check_client_run(cfg, node.options, node.privacy)  # a method that cannot bound its upload never sends one
    # fresh OS entropy for the noise, never the run's seed (the server knows it)
    reply = private_upload(reply, reference, np.random.default_rng(), node.privacy, cfg.run.strategy)
    if METRICS in reply.metric_records:
        declare_sizes(cfg.federation.population == "nodes", runtime, metrics_of(reply))
        if node.policy.memory_budget_mb or node.policy.precision != "fp32":  # what the node chose within its budget
            for key, value in plan_metrics(plan, runtime).items():
                reply.metric_records[METRICS][key] = value
    return reply


def evaluate_received(runtime: Runtime, content: RecordDict, num_tasks: int, own_data: bool) -> MetricRecord | None:
    """The counts an evaluate message would get for the arrays this train message carries, on
    tasks 0..``evaluate-task`` of the run's ``num_tasks`` (the server asks only where those arrays
    are the global model); ``own_data``: the node declares its data's sizes (``declare_sizes``).

    None, logged, when they cannot be computed: the update still goes back, and the server
    sends this node an evaluate message instead."""
    task = config_of(content)[EVALUATE_TASK]
    try:
        if not isinstance(task, int) or isinstance(task, bool) or not 0 <= task < num_tasks:
            raise ValueError(f"train message: {EVALUATE_TASK} {task!r} names no task in 0..{num_tasks - 1}")
        return evaluation_counts(runtime, arrays_of(content), task, {}, own_data)
    except Exception as exc:  # the evaluation must never cost the training update
        log.warning("evaluation asked with training not done (%s: %s); training goes on", type(exc).__name__, exc)
        return None


def private_upload(reply: RecordDict, received: ArrayRecord, rng: np.random.Generator, dp: PrivacyOptions,
                   strategy: str) -> RecordDict:
    """The train reply as it may leave this client: with ``dp.*`` on (``dp``: the run's options,
    the run checked first, ``check_client_run``), through the Gaussian mechanism
    (common/privacy.py) with method ``strategy``'s record bounds, the one place every method's
    upload is privatised; a reply with no examples releases nothing of the data and goes as it is."""
    if not dp.enabled or METRICS not in reply.metric_records or as_int(metrics_of(reply)["num-examples"]) == 0:
        return reply
    return privatise_reply(reply, received, private_records(strategy), dp, rng)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """A method's exchange before training (``PromptStrategy.configure_exchange``, e.g. Powder's
    measuring step): the method's learner answers it (``LocalLearner.answer``) without training."""
    node = message_context(context)
    cfg = node.cfg
    config = config_of(msg.content)
    check_same_config(node.digest, config)
    runtime, client_id = client_runtime(node, config)
    learner = learner_class(cfg.run.strategy).of(cfg, runtime, node.options, node.privacy)
    apply_plan(node, runtime)  # the model's no-grad chunks (the answer trains nothing)
    task, round_, client_id = assignment(config, client_id, cfg.federation.population, cfg.data.task_generator,
                                         cfg.federation.num_clients)
    return Message(content=learner.answer(msg.content, task, round_, client_id), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Per-task correct/total counts of the global model on this node's held-out data.

    The reply carries counts only (``metrics``: ``correct``, ``total`` per task seen so
    far, ``num-examples``); the server sums them over nodes into accuracies.
    """
    node = message_context(context)
    cfg = node.cfg
    config = config_of(msg.content)
    check_same_config(node.digest, config)
    runtime, _ = client_runtime(node, config)
    with startup.phase("context"):
        apply_plan(node, runtime)  # its no-grad chunks
    try:
        task = as_int(config["task"])
    except KeyError:
        raise ValueError("evaluate message config lacks 'task'") from None
    pools = evaluation_pools(config, task, runtime.model.prompt.num_tasks)
    metrics = evaluation_counts(runtime, arrays_of(msg.content), task, pools, cfg.federation.population == "nodes")
    report_process_cost(metrics)
    return Message(content=RecordDict({METRICS: metrics}), reply_to=msg)


def evaluation_counts(runtime: Runtime, arrays: ArrayRecord, task: int, pools: dict[int, list[int]],
                      own_data: bool) -> MetricRecord:
    """Per-task ``correct`` / ``total`` of ``arrays`` on this node's held-out data (each task
    through its own prompt slices where ``pools`` names them), and (``own_data``) the node's data sizes."""
    runtime.model.load_trainable_state(to_torch(arrays))
    correct, total = pooled_counts(runtime, task, pools) if pools else correct_counts(runtime, task)
    metrics = MetricRecord({
        "correct": [int(v) for v in correct],
        "total": [int(v) for v in total],
        "num-examples": int(np.sum(total)),
    })
    declare_sizes(own_data, runtime, metrics)
    return metrics


def evaluation_pools(config: ConfigRecord, task: int, slices: int) -> dict[int, list[int]]:
    """The ``pool-<task>`` entries of an evaluate message: the prompt slices each task is scored with."""
    pools: dict[int, list[int]] = {}
    for key, value in config.items():
        if not key.startswith(POOL_PREFIX):
            continue
        scored = key[len(POOL_PREFIX):]
        if not scored.isdigit() or int(scored) > task:
            raise ValueError(f"evaluate message: {key!r} names no task in 0..{task}")
        if not isinstance(value, list) or not value or \
                not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < slices for s in value):
            raise ValueError(f"evaluate message: {key!r} must list prompt slices in 0..{slices - 1}")
        pools[int(scored)] = [int(s) for s in value]
    return pools


def client_runtime(node: MessageContext, config: ConfigRecord) -> tuple[Runtime, int]:
    """This process's runtime for the message's context ``node`` and the client id it trains as
    (``-1``: the server assigns it).

    First the node's own limits and its backbone (:class:`NodePolicy`): a run beyond them, or
    naming a weights file or hub source the node did not choose, is refused before anything is
    built or opened. ``population = "nodes"``: the node's own data from its node config,
    checked against the run's classes (``num-classes`` sent by the server, ``class-names`` of
    the run). ``population = "virtual"`` loads the run's dataset, which a deployed node does
    only with ``data-from-run = true``. A simulated client (a Ray actor) given no GPU share
    trains on the CPU.
    """
    policy, cfg = node.policy, node.cfg
    with startup.phase("context"):
        policy.check_run(cfg, config.get("num-classes"), node.options, node.privacy)
        # the node's own weights or its cache, never a file the run names
        cfg = cfg.replace(weights=policy.backbone_weights(cfg.model.backbone, cfg.model.weights))
    method_prompt = prompt_class(cfg.run.strategy)
    if cfg.placement.device == "auto" and in_ray_actor() and ray_gpu_share() == 0:
        # a client actor given no GPU trains on the CPU, even where Ray leaves the GPUs visible
        # (Ray announces it will stop hiding them from such actors)
        cfg = cfg.replace(device="cpu")
    if cfg.federation.population == "virtual":
        if not policy.data_from_run:
            raise NodeRefusal("node refuses the run: population = virtual loads the run's own dataset "
                              f"({cfg.data.dataset!r}), and this node reads only the data its node-config names; "
                              "use population = nodes (or start the node with data-from-run=true)")
        return get_runtime(cfg, method_prompt, precision=policy.precision), -1
    with startup.phase("data"):
        own = node_data(cfg, node.node_config, policy)
    sent = config.get("num-classes")
    if sent is not None:
        check_classes(own.data.num_classes, original_names(own.data, cfg.run.seed),
                      f"this node's data ({own.data.name})", cfg.data.num_classes or as_int(sent),
                      cfg.data.class_name_list)
    return (get_runtime(own.cfg, method_prompt, data=own.data, precision=policy.precision, partition=own.partition),
            own.client_id)


def assignment(config: ConfigRecord, node_client: int, population: str, task_generator: str,
               num_clients: int) -> tuple[int, int, int]:
    """(task, round within task, client id) this message asks for.

    A virtual client (``population``) is the id the server names; a node is itself
    (``node_client``), except with random tasks (``task_generator``), where it plays the
    schedule's client of its turn (``schedule-slot``, one of the run's ``num_clients``).
    """
    task, round_, assigned = read_task_round(config)
    if population == "virtual":
        return task, round_, assigned
    if task_generator == "random":
        slot = config.get("schedule-slot")
        if not isinstance(slot, int) or not 0 <= slot < num_clients:
            raise ValueError(f"random tasks: the message's schedule-slot {slot!r} is not a client of the "
                             f"run's {num_clients}")
        return task, round_, slot
    return task, round_, node_client


def declare_sizes(own_data: bool, runtime: Runtime, metrics: MetricRecord) -> None:
    """A node with its own data (``own_data``: ``population = "nodes"``) states how much it holds;
    the server bounds its counts by it."""
    if own_data:
        metrics["train-size"] = len(runtime.data.train)
        metrics["test-size"] = len(runtime.data.test)


def report_process_cost(metrics: MetricRecord) -> None:
    """This message's process cost, for the server's deployment-overhead figures: the process's
    age now and, in a fresh process's first message, its start-up phases (common/node/startup.py)."""
    metrics["process-seconds"] = startup.process_age()
    for name, seconds in startup.take().items():
        metrics[startup.metric_name(name)] = seconds


def ray_gpu_share() -> float:
    """The share of a GPU Ray gave this actor (its assigned resources, set by the simulation's plan)."""
    return float(sys.modules["ray"].get_runtime_context().get_assigned_resources().get("GPU", 0.0))


def placement(runtime: Runtime, context: Context, digest: str) -> ConfigRecord:
    """Where this message was trained: the Ray node (simulation) or Flower node (deployment),
    the torch device, the CUDA_VISIBLE_DEVICES this process saw (Ray sets it per actor), and
    the digest of the run config this node trained under (the server records it)."""
    node = sys.modules["ray"].get_runtime_context().get_node_id() if in_ray_actor() else None
    device = runtime.device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    fields: dict[str, Any] = {"node": str(node or context.node_id), "device": str(device), "config-digest": digest}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        fields["cuda-visible-devices"] = visible
    return ConfigRecord(fields)


def check_same_config(digest: str, config: ConfigRecord) -> None:
    """Refuse to work under a configuration (``digest``: this client's ``ExperimentConfig.digest``)
    other than the server's, and a message that does not say which: the ServerApp puts its run's
    digest in every train, query and evaluate message it sends (strategies/platform/sampling.py,
    server/evaluation.py), so a message without one was not made by this run's server (a node
    pushing a message "from the SuperLink", which deploy/fleet_gate.py also refuses)."""
    theirs = config.get("config-digest")
    if theirs is None:
        raise ValueError("the message carries no config-digest: every message of this run's server says its "
                         "run config's digest, so this one was not made by it; refused")
    if theirs != digest:
        raise ValueError(
            f"this client's run config (digest {digest}) differs from the server's ({printable(str(theirs), 80)!r}); "
            "both sides must run the same promptfcl configuration"
        )


__all__ = ["app", "check_same_config", "client_runtime", "evaluate", "evaluate_received", "evaluation_counts",
           "private_upload", "public_reason", "query", "report_errors", "train", "NodeDataError", "NodeError"]


# Process start to here: the interpreter, Flower's ClientApp runner and this module's imports
# (torch, the project); in a fresh deployed process, the first part of every message's cost.
startup.record("imports", startup.process_age())
