"""The strategy every method builds on: Flower's Message-API FedAvg, made task-aware.

``PromptStrategy`` keeps Flower's ``configure_train`` / ``aggregate_train``
contract (typed records in and out) and adds the hooks the papers' methods need:

* ``client_payload(client_id, arrays, config)``  per-client server-to-client content
* ``consolidate(server_round, arrays, replies)``  server-side step after averaging
* ``on_task_start(task, arrays)`` / ``on_task_end(task, arrays)``
* ``configure_exchange`` / ``aggregate_exchange``  an optional exchange before a round's training
* ``state_dict()`` / ``load_state_dict()``  everything a checkpoint must hold

Clients are a *virtual population*: the server samples client ids (a pure
function of seed, task and round) and tells each Flower node which client it
plays this round, so the per-round cost does not depend on the population size.
With ``population = "nodes"`` (deployment, deploy/README.md) every Flower node is one
client with its own data instead (``configure_train_nodes``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from promptfcl.common.config import ConfigError, ExperimentConfig
from promptfcl.common.data import task_rows
from promptfcl.common.model import CodaPrompt
from promptfcl.common.privacy import PrivateRecord, check_privacy
from promptfcl.common.records import (ARRAYS, CONFIG, EVALUATE_TASK, EVALUATION, METRICS, PLACEMENT, PLACEMENT_FIELDS,
                            from_array_record, payload_bytes, to_array_record)
from promptfcl.common.schedule import task_schedule
from promptfcl.strategies.platform.replies import REPLY_METRICS, MetricSpec, capped_weights, check_metrics, combine, norm_outliers, update_norm

log = logging.getLogger("promptfcl")

#: records any reply may carry besides the method's own; the base validates placement, the server
#: loop the evaluation counts a train reply carries (evaluate-with-train)
PLATFORM_RECORDS = frozenset({PLACEMENT, EVALUATION})


class PromptStrategy(FedAvg):
    """Sample-weighted FedAvg over prompt and head parameters, aware of the task schedule.

    Parameters
    ----------
    cfg : ExperimentConfig
        The run's configuration (sampling, seed, prompt sizes).
    num_classes : int
        Classes of the whole stream (size of the head).
    options : dict, optional
        Method options (``<strategy>.*`` run-config keys without the prefix).
    """

    name = "fedavg"
    #: prompt module of this method (clients build their model with it; the server
    #: uses it to initialise task slices). Must take CodaPrompt's constructor arguments.
    prompt_class: type[CodaPrompt] = CodaPrompt
    #: with clients on several tasks in a round, average each task's slice and head rows over
    #: the replies that trained it (``average_replies``); False: FedAvg-Prompt's plain average
    per_task_in_flight: bool = False
    #: record names a client reply must carry, exactly (None: "arrays" and "metrics"
    #: required, extra records allowed). Methods that upload statistics list them here.
    reply_records: frozenset[str] | None = frozenset({ARRAYS, METRICS})
    #: the method's options dataclass (with a ``from_options(dict)`` classmethod that
    #: raises ConfigError on a bad value or unknown key); None: the method takes none
    options_class: Any = None
    #: differential privacy (common/privacy.py): how each extra upload record is bounded (the
    #: ``arrays`` update always is); a record the client uploads and this does not name is refused
    private_records: dict[str, PrivateRecord] = {}
    #: the fields a train reply's metrics record may hold (strategies/replies.py)
    reply_metrics: dict[str, MetricSpec] = REPLY_METRICS
    #: whether the method works when clients are on different tasks in the same round
    #: (``switch-fraction`` < 1, common/schedule.py); methods whose task-end step assumes
    #: every client has finished the task set this False
    asynchronous_tasks: bool = True
    #: whether the method runs on Powder's random tasks (``task-generator = "random"``): tasks
    #: of overlapping classes, one client each, with no nominal task ends
    random_tasks: bool = True

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        """Validate ``<strategy>.*`` options before any training (raises ConfigError)."""
        if cls.options_class is not None:
            cls.options_class.from_options(options)
        elif options:
            raise ConfigError(f"strategy {cls.name!r} takes no options, got {sorted(options)}")

    def __init__(self, cfg: ExperimentConfig, num_classes: int, options: dict[str, Any] | None = None) -> None:
        # Sampling is ours (seeded, see sample_clients); Flower's fraction settings are unused.
        super().__init__(fraction_train=1.0, fraction_evaluate=1.0, min_train_nodes=1, min_available_nodes=1)
        self.cfg = cfg
        self.num_classes = num_classes
        self.options = dict(options or {})
        self.sent_arrays: ArrayRecord | None = None  # what this round's replies must match
        self.rejected: list[tuple[int, str]] = []  # (node id, reason) of the last aggregation
        self.sent_messages: list[Message] = []  # this round's train messages, in order
        self._sent_by_id: dict[str, int] = {}  # their ids (set by the grid on sending) -> index
        self.max_examples: int | None = None  # the most samples a client can hold (set by the server)
        # virtual population: (client, task, round) -> the samples that client holds (set by the server,
        # which has the data), so a reply's count is checked exactly
        self.examples_of: Callable[[int, int, int], int] | None = None
        # population = nodes: data sizes each node declared in its first reply (train, test), by node id
        self.node_sizes: dict[int, tuple[int, int]] = {}
        self.update_norms: list[float] = []  # the last aggregation's accepted update norms
        self.reply_shares: list[float] = []  # the last aggregation's weight shares (reply_weights)
        self.accepted_messages: list[Message] = []  # the last aggregation's accepted replies
        self.placements: dict[str, dict[str, str]] = {}  # reply-to message id -> where an accepted reply trained
        self._sent_numpy: tuple[ArrayRecord | None, dict[str, np.ndarray]] = (None, {})
        self._warned_few_nodes = False
        self._nodes_ready = False  # population = "nodes": the first round has found its nodes
        self.schedule = self.check_schedule(cfg)
        self.check_privacy(cfg)
        # client id -> its turn in the task schedule (set when the server sends it a task)
        self.schedule_slots: dict[int, int] = {}

    @classmethod
    def check_schedule(cls, cfg: ExperimentConfig) -> Any:
        """The run's task schedule, if this method can follow it (else ConfigError, before any loading)."""
        schedule = task_schedule(cfg)
        if cfg.task_generator == "random" and not (cls.random_tasks and cls.asynchronous_tasks):
            raise ConfigError(f"strategy {cls.name!r} needs the shared task stream (task-generator = stream): "
                              "its server step assumes tasks of disjoint classes in stream order")
        if not schedule.synchronous and not cls.asynchronous_tasks:
            raise ConfigError(f"strategy {cls.name!r} needs synchronous task arrival (switch-fraction = 1 and "
                              f"switch-every = 0): {schedule.describe()}")
        return schedule

    @classmethod
    def privacy_refusal(cls, cfg: ExperimentConfig) -> str:
        """Why this method cannot bound its uploads under ``cfg`` ("": it can); options may matter."""
        return ""

    @classmethod
    def check_privacy(cls, cfg: ExperimentConfig) -> None:
        """Refuse ``dp.*`` (ConfigError) for a method whose upload cannot be bounded, before any loading."""
        check_privacy(cfg, cls.name, cls.privacy_refusal(cfg))

    def uploaded_features(self, classes: list[int], seed: int) -> list[dict[str, Any]] | None:
        """Feature vectors clients uploaded of ``classes`` (what the privacy audit inverts; those
        the server holds none of are left out): dicts with ``class``, ``kind``, ``vector`` (D,),
        ``client`` and ``meta``; None: the method uploads no features (the audit inverts head rows)."""
        return None

    def audit_notes(self) -> dict[str, Any]:
        """What else the server's state shows of the clients, for the privacy audit's report."""
        return {}

    def summary(self) -> None:
        log.info("strategy %s: %s clients per round out of %d, options %s",
                 self.name, self.clients_per_round, self.cfg.num_clients, self.options or "{}")
        log.info("task arrival: %s", self.schedule.describe())

    # ------------------------------------------------------------------ sampling
    @property
    def clients_per_round(self) -> int:
        if self.cfg.centralised:
            return 1
        if self.cfg.clients_per_round > 0:
            return self.cfg.clients_per_round
        return max(1, int(round(self.cfg.client_fraction * self.cfg.num_clients)))

    @property
    def population_size(self) -> int:
        """How many clients a round samples from (centralised: the one client with all data)."""
        return 1 if self.cfg.centralised else self.cfg.num_clients

    @property
    def sample_rate(self) -> float:
        """The share of the population one round trains: differential privacy's sampling rate q."""
        return min(1.0, self.clients_per_round / self.population_size)

    def sample_clients(self, task: int, round_: int, attempt: int = 0) -> list[int]:
        """Client ids for (task, round): seeded, independent of history and of node ids.

        ``attempt`` > 0 draws afresh when a round is retried after too few usable replies.
        """
        rng = np.random.default_rng([self.cfg.seed, task, round_, attempt, 0x5A3])
        return sorted(rng.choice(self.population_size, size=self.clients_per_round, replace=False).tolist())

    # ------------------------------------------------------------------ hooks
    def client_payload(self, client_id: int, arrays: ArrayRecord, config: ConfigRecord) -> RecordDict:
        """Content sent to one client. Methods add records or send a subset of the arrays."""
        return RecordDict({ARRAYS: arrays, CONFIG: config})

    def consolidate(self, server_round: int, arrays: ArrayRecord, replies: list[RecordDict]) -> ArrayRecord:
        """Server-side step after averaging (distillation, debiasing, ...). Default: none."""
        return arrays

    def on_task_start(self, task: int, arrays: ArrayRecord) -> ArrayRecord:
        """Initialise the new task's prompt slice orthogonally to the earlier ones (CODA-P)."""
        state = from_array_record(arrays)
        prompt = self._prompt_from(state)
        gen = torch.Generator().manual_seed(int(np.random.default_rng([self.cfg.seed, task, 0x0A7]).integers(2**31)))
        prompt.init_task_slice(task, gen, orthogonal=self.cfg.ortho_init)
        state.update({f"prompt.{k}": v.numpy() for k, v in prompt.state_dict().items()})
        return to_array_record(state)

    def on_task_end(self, task: int, arrays: ArrayRecord) -> ArrayRecord:
        """Called after the last round of ``task``. Default: nothing to do."""
        return arrays

    def state_dict(self) -> dict[str, Any]:
        """Strategy state a checkpoint must hold (NumPy arrays and plain values)."""
        return {}

    def platform_state(self) -> dict[str, Any]:
        """What every strategy keeps for the platform across a resume (the nodes' declared sizes, each
        client's turn in the task schedule)."""
        return {"node-sizes": {str(k): list(v) for k, v in self.node_sizes.items()},
                "schedule-slots": {str(k): int(v) for k, v in self.schedule_slots.items()}}

    def load_platform_state(self, state: dict[str, Any]) -> None:
        self.node_sizes = {int(k): (int(v[0]), int(v[1])) for k, v in state.get("node-sizes", {}).items()}
        self.schedule_slots = {int(k): int(v) for k, v in state.get("schedule-slots", {}).items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""

    def evaluation_pools(self, arrays: ArrayRecord, upto: int) -> tuple[ArrayRecord, dict[int, list[int]]] | None:
        """How to score tasks 0..``upto``: None scores the global ``arrays`` once for all tasks;
        else (arrays, {task: the prompt slices its prompt module uses}) scores each task with
        its own slices (``local_tasks`` of the prompt module), as methods whose clients train
        with per-task local pools are evaluated."""
        return None

    def configure_exchange(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> list[Message]:
        """Messages (type ``query``) the server loop exchanges with clients before this round's
        training, e.g. Powder's measuring step (Algorithm 1, lines 8-10); their replies go to
        ``aggregate_exchange``, then ``configure_train`` runs. Default: none."""
        return []

    def aggregate_exchange(self, server_round: int, replies: list[Message]) -> None:
        """Use the replies to ``configure_exchange``'s messages. Default: nothing to use."""

    # ------------------------------------------------------------------ Flower contract
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One message per sampled client; ``config`` must carry ``task`` and ``round``."""
        task, round_ = int(config["task"]), int(config["round"])
        if self.cfg.population == "nodes":
            messages = self.configure_train_nodes(server_round, arrays, config, grid)
        else:
            messages = self.configure_train_virtual(server_round, arrays, config, grid, task, round_)
        self.sent_messages, self._sent_by_id = messages, {}
        return messages

    def configure_train_virtual(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid,
                                task: int, round_: int) -> list[Message]:
        """Simulation: sampled client ids, played by the connected nodes in turn."""
        clients = self.sample_clients(task, round_, int(config.get("attempt", 0)))
        nodes = sorted(grid.get_node_ids())
        if not nodes:
            raise RuntimeError("no Flower nodes are connected")
        if len(nodes) < len(clients) and not self._warned_few_nodes:
            log.warning("%d clients per round but %d Flower nodes: nodes play several clients in turn "
                        "(start more SuperNodes / num-supernodes for parallelism)", len(clients), len(nodes))
            self._warned_few_nodes = True
        self.sent_arrays = arrays
        messages = []
        for i, client_id in enumerate(clients):
            node_id = nodes[i % len(nodes)]  # virtual clients: any node can play any client
            node_config = self.client_config(config, client_id, client_id, server_round)
            content = self.client_payload(client_id, arrays, node_config)
            messages.append(Message(content=content, message_type=MessageType.TRAIN, dst_node_id=node_id))
        return messages

    def sent_candidates(self, reply: Message) -> list[int]:
        """Indices in ``sent_messages`` of the messages ``reply`` may answer (empty: none of this round's).

        By message id, exactly one (the grid sets ids when it sends, so the map is built at the
        first reply); when the sent messages carry no ids, every message sent to the reply's node.
        """
        if not self._sent_by_id:
            self._sent_by_id = {m.metadata.message_id: i for i, m in enumerate(self.sent_messages)
                                if m.metadata.message_id}
        if self._sent_by_id:
            index = self._sent_by_id.get(reply.metadata.reply_to_message_id)
            return [] if index is None else [index]
        return [i for i, m in enumerate(self.sent_messages) if m.metadata.dst_node_id == reply.metadata.src_node_id]

    def client_config(self, config: ConfigRecord, client_id: int, client_index: int,
                      server_round: int) -> ConfigRecord:
        """The round's config for one client: its id, and its own task when tasks arrive asynchronously."""
        node_config = ConfigRecord(dict(config))
        node_config["client-id"] = client_id
        node_config["server-round"] = server_round
        node_config["config-digest"] = self.cfg.digest()
        self.schedule_slots[client_id] = client_index % self.schedule.num_clients
        if not self.schedule.synchronous:
            task, round_ = self.schedule.assignment(client_index % self.schedule.num_clients, server_round - 1)
            node_config["task"], node_config["round"] = task, round_
        if self.cfg.task_generator == "random":  # a deployed node plays the schedule's client of its turn
            node_config["schedule-slot"] = client_index % self.schedule.num_clients
        return node_config

    # ------------------------------------------------------------------ deployment: one client per node
    # population = "nodes": every connected Flower node is one client with its own data
    # (deploy/README.md). The server samples among the connected node ids with a seeded
    # RNG over the sorted ids; each node trains as itself.
    def connected_nodes(self, grid: Grid, minimum: int, timeout: float) -> list[int]:
        """Sorted ids of the connected nodes, waiting up to ``timeout`` s for ``minimum`` of them."""
        import time

        started = last_log = time.monotonic()
        while True:
            nodes = sorted(int(n) for n in grid.get_node_ids())
            if len(nodes) >= minimum:
                return nodes
            now = time.monotonic()
            if now - started > timeout:
                raise RuntimeError(
                    f"only {len(nodes)} of the {minimum} nodes the run needs connected within {timeout:.0f} s; "
                    "start more SuperNodes (or lower num-clients / min-replies)")
            if now - last_log > 10 or now == started:
                log.info("waiting for nodes: %d of %d connected", len(nodes), minimum)
                last_log = now
            time.sleep(1.0)

    def sample_nodes(self, nodes: list[int], task: int, round_: int, attempt: int = 0) -> list[int]:
        """``clients-per-round`` of the connected ``nodes`` (all if fewer), seeded by (seed, task, round)."""
        rng = np.random.default_rng([self.cfg.seed, task, round_, attempt, 0x5A3])
        k = min(self.clients_per_round, len(nodes))
        return [nodes[i] for i in sorted(rng.choice(len(nodes), size=k, replace=False).tolist())]

    def configure_train_nodes(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> list[Message]:
        """One message per sampled node; ``client-id`` is the node's (62-bit) id."""
        task, round_ = int(config["task"]), int(config["round"])
        # before the first round, wait for the whole population; later, for enough to aggregate
        minimum = self.cfg.num_clients if not self._nodes_ready else self.cfg.min_replies
        nodes = self.connected_nodes(grid, minimum, self.cfg.round_timeout)
        self._nodes_ready = True
        self.sent_arrays = arrays
        messages = []
        for node_id in self.sample_nodes(nodes, task, round_, int(config.get("attempt", 0))):
            client_id = node_client_id(node_id)
            # a node's place in the sorted connected ids is its turn in the task schedule
            node_config = self.client_config(config, client_id, nodes.index(node_id), server_round)
            node_config["num-classes"] = self.num_classes
            content = self.client_payload(client_id, arrays, node_config)
            messages.append(Message(content=content, message_type=MessageType.TRAIN, dst_node_id=node_id))
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate replies, average the accepted ones by sample count, then consolidate."""
        accepted = self.accept_replies(list(replies))
        if len(accepted) < self.cfg.min_replies:
            log.warning("round %d: %d usable replies, fewer than min-replies = %d; the global model is unchanged",
                        server_round, len(accepted), self.cfg.min_replies)
            return None, None
        weights = self.reply_weights(accepted)
        arrays = self.average_replies(accepted, weights)
        arrays = self.consolidate(server_round, arrays, accepted)
        metrics = MetricRecord({
            "num-examples": int(sum(int(c[METRICS]["num-examples"]) for c in accepted)),
            "clients": len(accepted),
            "train-loss": float(np.average([float(c[METRICS]["train-loss"]) for c in accepted], weights=weights)),
        })
        return arrays, metrics

    # ------------------------------------------------------------------ replies: checks and weights
    def accept_replies(self, replies: list[Message]) -> list[RecordDict]:
        """Keep the replies that pass every check (:meth:`check_reply`), then drop update-norm outliers.

        Rejected replies are logged and listed in ``rejected`` with the id of the node that
        was sent the message (a dead node's error reply comes from the SuperLink).
        """
        self.rejected = []
        self.placements = {}
        self.reply_shares = []
        kept: list[Message] = []
        for msg in replies:
            try:
                reason = self.check_reply(msg)
            except Exception as exc:  # a check must never take the server down, whatever a reply holds
                reason = f"reply could not be checked ({type(exc).__name__}: {exc})"
            if reason is None:
                kept.append(msg)
            else:
                self._reject(msg, reason)
        norms = [self.reply_update_norm(m) for m in kept]
        accepted, self.update_norms, self.accepted_messages = [], [], []
        for msg, norm, reason in zip(kept, norms, norm_outliers(norms, self.cfg.update_norm_factor,
                                                                self.cfg.max_update_norm)):
            if reason is not None:
                self._reject(msg, reason)
                continue
            accepted.append(msg.content)
            self.accepted_messages.append(msg)
            self.update_norms.append(norm)
            if PLACEMENT in msg.content:
                self.placements[msg.metadata.reply_to_message_id] = dict(msg.content[PLACEMENT])
        return accepted

    def _reject(self, msg: Message, reason: str) -> None:
        node = self.sender_of(msg)
        self.rejected.append((node, reason))
        level = logging.DEBUG if reason == "no training examples" else logging.WARNING
        log.log(level, "reply from node %s excluded: %s", node, reason)

    def sender_of(self, msg: Message) -> int:
        """The node a reply stands for: the one its message was sent to (a dead node's error
        reply is made by the SuperLink, under the SuperLink's id)."""
        candidates = self.sent_candidates(msg)
        if len(candidates) == 1:
            return int(self.sent_messages[candidates[0]].metadata.dst_node_id)
        return int(msg.metadata.src_node_id)

    def sent_config(self, msg: Message) -> ConfigRecord | None:
        """The config of the message ``msg`` answers (None: unknown)."""
        candidates = self.sent_candidates(msg)
        if len(candidates) != 1:
            return None
        content = self.sent_messages[candidates[0]].content
        return content[CONFIG] if CONFIG in content.config_records else None

    def assigned_task(self, msg: Message) -> int | None:
        """The task the server sent the client whose reply is ``msg`` (None: unknown).

        Read from the server's own message, never from the reply: a client cannot choose
        which task its statistics or prototypes count for.
        """
        config = self.sent_config(msg)
        return None if config is None or "task" not in config else int(config["task"])

    def assigned_client(self, msg: Message) -> int | None:
        """The client id the server sent the message ``msg`` answers (None: unknown)."""
        config = self.sent_config(msg)
        return None if config is None or "client-id" not in config else int(config["client-id"])

    def reply_origins(self, replies: list[RecordDict]) -> list[tuple[int | None, int | None]] | None:
        """(client id, task) the server assigned each accepted reply, None where unknown.

        ``replies`` are the last aggregation's accepted replies (what ``consolidate`` gets),
        in the order of ``accepted_messages``; None when they are not (a direct call).
        """
        if len(self.accepted_messages) != len(replies) or any(
                m.content is not c for m, c in zip(self.accepted_messages, replies)):
            return None
        return [(self.assigned_client(m), self.assigned_task(m)) for m in self.accepted_messages]

    def client_position(self, client_id: int, round_index: int) -> int:
        """The task ``client_id`` is on in ``round_index`` (0-based), by the schedule."""
        slot = self.schedule_slots.get(client_id, client_id % self.schedule.num_clients)
        return self.schedule.position(slot, round_index)

    def tasks_in_flight(self, round_index: int) -> range:
        """The tasks some client of the population is on in ``round_index`` (slowest to newest)."""
        return range(self.schedule.position(self.schedule.slowest_client, round_index),
                     self.schedule.newest_task(round_index) + 1)

    def reply_start(self, msg: Message) -> dict[str, np.ndarray] | None:
        """The arrays the reply's client started from (its update is the difference); None: unknown,
        the reply's own norm is used. Methods whose payload differs per client override it."""
        if self.sent_arrays is None:
            return None
        if self._sent_numpy[0] is not self.sent_arrays:  # decoded once per round, not per reply
            self._sent_numpy = (self.sent_arrays, from_array_record(self.sent_arrays))
        return self._sent_numpy[1]

    def reply_update_norm(self, msg: Message) -> float:
        return update_norm(from_array_record(msg.content[ARRAYS]), self.reply_start(msg))

    def reply_weights(self, accepted: list[RecordDict]) -> np.ndarray:
        """Aggregation weights, for every method: sample counts, each capped at ``max-client-weight``
        of the round when the counts cannot be verified (``population = "nodes"``) and 2 or more
        replies arrived. Their shares are kept in ``reply_shares`` (the round's record)."""
        counts = np.array([int(c[METRICS]["num-examples"]) for c in accepted], dtype=np.float64)
        weights = counts  # every use normalises; unnormalised counts keep FedAvg's arithmetic as it was
        if self.cfg.population == "nodes" and len(counts) >= 2 and counts.max() > self.cfg.max_client_weight * counts.sum():
            weights = capped_weights(counts, self.cfg.max_client_weight)
        self.reply_shares = [float(w) for w in weights / weights.sum()] if weights.sum() > 0 else []
        return weights

    def average_replies(self, accepted: list[RecordDict], weights: np.ndarray) -> ArrayRecord:
        """The accepted replies' arrays, averaged (``combine_arrays``).

        With ``per_task_in_flight`` and clients on several tasks in the round (asynchronous
        arrival), each task's prompt slice and head rows are averaged over the replies whose
        client was sent that task (``aggregate_per_task``), as Fed-CPrompt and Powder do: a
        slice trained only by the clients that are ahead is not diluted by the others'
        untouched copies. One task in the round (synchronous arrival): the plain average.
        """
        tasks = [self.assigned_task(m) for m in self.accepted_messages]
        if (self.per_task_in_flight and self.sent_arrays is not None and len(tasks) == len(accepted)
                and None not in tasks and len(set(tasks)) > 1):
            updates = [(int(t), from_array_record(c[ARRAYS]), float(w)) for t, c, w in zip(tasks, accepted, weights)]
            return to_array_record(aggregate_per_task(self.cfg, from_array_record(self.sent_arrays), updates,
                                                      self.num_classes))
        return self.combine_arrays([c[ARRAYS] for c in accepted], weights)

    def combine_arrays(self, records: list[ArrayRecord], weights: np.ndarray) -> ArrayRecord:
        """The round's arrays from the accepted replies (``aggregation``: mean, median, trimmed mean)."""
        out = {}
        for name in records[0].keys():
            out[name] = combine([r[name].numpy() for r in records], weights, self.cfg.aggregation,
                                self.cfg.trim_fraction)
        return to_array_record(out)

    def expected_arrays(self, reply: Message) -> ArrayRecord | None:
        """The arrays ``reply`` must match in names, shapes and dtypes: by default what this round
        sent everyone. Methods whose payload differs per client return that client's."""
        return self.sent_arrays

    def check_reply(self, msg: Message) -> str | None:
        """Why a reply cannot be aggregated, or None if it can."""
        if msg.has_error():
            return f"client error: {msg.error.reason}"
        if self.sent_messages and not self.sent_candidates(msg):
            return "cannot tell which message this reply answers (no matching message sent this round)"
        content = msg.content
        if ARRAYS not in content.array_records or METRICS not in content.metric_records:
            return "missing 'arrays' or 'metrics' record"
        if PLACEMENT in content:
            reason = check_placement(content)
            if reason is not None:
                return reason
        if EVALUATION in content:  # the server loop reads its counts; here only whether it may be there
            sent = self.sent_config(msg)
            if EVALUATION not in content.metric_records or sent is None or EVALUATE_TASK not in sent:
                return f"an {EVALUATION!r} record this message did not ask for (or not a metric record)"
        names = method_records(content)
        if self.reply_records is not None and names != set(self.reply_records):
            extra, missing = names - self.reply_records, self.reply_records - names
            return f"unexpected records {sorted(extra)}, missing records {sorted(missing)}"
        reason = check_metrics(content[METRICS], self.reply_metrics)
        if reason is not None:
            return reason
        n = int(content[METRICS]["num-examples"])
        if n == 0:
            return "no training examples"
        reason = self.check_examples(msg, n)
        if reason is not None:
            return reason
        size = payload_bytes(content)
        if size > self.cfg.max_reply_bytes:
            return f"reply of {size} bytes exceeds max-reply-bytes = {self.cfg.max_reply_bytes}"
        reply, sent = content[ARRAYS], self.expected_arrays(msg)
        if sent is not None:
            if set(reply.keys()) != set(sent.keys()):
                return f"array names differ from those sent: {sorted(set(reply.keys()) ^ set(sent.keys()))[:4]}"
            for name in sent.keys():
                if tuple(reply[name].shape) != tuple(sent[name].shape) or reply[name].dtype != sent[name].dtype:
                    return f"array {name}: {reply[name].dtype}{reply[name].shape} != sent {sent[name].dtype}{sent[name].shape}"
        for name in reply.keys():
            if not np.isfinite(reply[name].numpy()).all():
                return f"array {name} has non-finite values"
        return None

    def check_examples(self, msg: Message, n: int) -> str | None:
        """Why a reply's sample count cannot be right (None: it can).

        Virtual population: exactly the samples the server knows the client holds for the
        task and round it was sent. Nodes: at most what the node declared in its first reply.
        """
        if self.max_examples is not None and n > self.max_examples:
            return f"implausible num-examples {n} (a client holds at most {self.max_examples})"
        config = self.sent_config(msg)
        if self.examples_of is not None and config is not None:
            expected = self.examples_of(int(config["client-id"]), int(config["task"]), int(config["round"]))
            if n != expected:
                return f"num-examples {n}, but client {int(config['client-id'])} holds {expected} for this task"
        if self.cfg.population == "nodes":
            return self.check_declared_sizes(int(msg.metadata.src_node_id), msg.content[METRICS], n)
        return None

    def check_declared_sizes(self, node: int, metrics: Any, examples: int | None = None,
                             test_total: int | None = None) -> str | None:
        """A node's data sizes: declared once (its first reply), then fixed; counts within them."""
        if "train-size" not in metrics or "test-size" not in metrics:
            return "a node must declare its train-size and test-size"
        declared = (int(metrics["train-size"]), int(metrics["test-size"]))
        known = self.node_sizes.setdefault(node, declared)
        if declared != known:
            return f"declared data sizes {declared} differ from the node's first declaration {known}"
        if examples is not None and examples > known[0]:
            return f"num-examples {examples} exceeds the node's declared train-size {known[0]}"
        if test_total is not None and test_total > known[1]:
            return f"evaluated on {test_total} samples, more than the node's declared test-size {known[1]}"
        return None

    def placement_of(self, message: Message) -> dict[str, Any]:
        """``message``'s client and where its accepted reply trained (None where unknown or rejected)."""
        config = message.content[CONFIG] if CONFIG in message.content.config_records else {}
        where = self.placements.get(message.metadata.message_id, {})
        return {"client": int(config["client-id"]) if "client-id" in config else None,
                "node": where.get("node"), "device": where.get("device"),
                "cuda_visible_devices": where.get("cuda-visible-devices"),
                "config_digest": where.get("config-digest")}

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Evaluation is centralised by the server loop (simulation); no client messages."""
        return []

    # ------------------------------------------------------------------ helpers
    def _prompt_from(self, state: dict[str, np.ndarray]) -> CodaPrompt:
        """A prompt module holding the prompt arrays of ``state`` (no backbone needed)."""
        layer0 = self.cfg.layers[0]
        dim = int(state[f"prompt.k{layer0}"].shape[1])
        prompt = self.prompt_class(dim, self.cfg.layers, self.cfg.pool_size, self.cfg.prompt_length, self.cfg.num_tasks)
        prompt.load_state_dict({k[7:]: torch.from_numpy(v.copy()) for k, v in state.items() if k.startswith("prompt.")})
        return prompt


def method_records(content: RecordDict) -> set[str]:
    """Names of the records a reply carries for the method (the platform's own left out)."""
    return set(content.keys()) - PLATFORM_RECORDS


def check_placement(content: RecordDict) -> str | None:
    """Why a reply's placement record is malformed (None: it is fine)."""
    if PLACEMENT not in content.config_records:
        return f"{PLACEMENT!r} is not a config record"
    record = content[PLACEMENT]
    unknown = set(record.keys()) - set(PLACEMENT_FIELDS)
    if unknown:
        return f"{PLACEMENT!r} has unknown fields {sorted(unknown)[:4]}"
    for key in record.keys():
        value = record[key]
        if not isinstance(value, str) or len(value) > 256:
            return f"{PLACEMENT}.{key} must be a string of at most 256 characters"
    return None


def node_client_id(node_id: int) -> int:
    """A Flower node id (uint64) as a non-negative int64 client id (its low 62 bits)."""
    return int(node_id) & ((1 << 62) - 1)


def weighted_average(records: list[ArrayRecord], weights: np.ndarray) -> ArrayRecord:
    """Sum_i w_i x_i / Sum_i w_i per array, accumulated in float64, cast back to the input dtype."""
    return to_array_record({name: combine([r[name].numpy() for r in records], weights)
                            for name in records[0].keys()})


# ---------------------------------------------------------------------------- per-slice FedAvg
def aggregate_per_task(
    cfg: ExperimentConfig,
    base: Mapping[str, np.ndarray],
    updates: list[tuple[int, Mapping[str, np.ndarray], float]],
    num_classes: int,
) -> dict[str, np.ndarray]:
    """FedAvg per task slice, all tasks of the round in parallel.

    Parameters
    ----------
    cfg : ExperimentConfig
        Locates a task's rows (``common.data.task_rows``): its slice of every prompt array,
        its classes' rows of every head array.
    base : dict
        The server's arrays this round started from (values of rows nobody trained).
    updates : list of (task, arrays, weight)
        Each accepted reply: the task its client trained, its arrays, its sample count.
    num_classes : int
        Classes of the head.

    Each row is the sample-weighted average over the replies whose task owns it, so a
    head row shared by two tasks (random tasks of overlapping classes) averages both.
    Any array that is not task-structured is averaged over all replies. With
    ``aggregation`` = median or trimmed-mean, each row is instead the coordinate-wise median
    (trimmed mean) over the replies whose task owns it.
    """
    all_weights = np.array([w for _, _, w in updates], dtype=np.float64)
    out: dict[str, np.ndarray] = {}
    for name, value in base.items():
        value = np.asarray(value)
        if task_rows(cfg, name, value, 0, num_classes) is None:  # not task-structured: every reply
            if cfg.aggregation != "mean":
                out[name] = combine([a[name] for _, a, _ in updates], all_weights, cfg.aggregation, cfg.trim_fraction)
                continue
            acc = sum(w * np.asarray(a[name], dtype=np.float64) for (_, a, _), w in
                      zip(updates, all_weights / all_weights.sum()))
            out[name] = np.asarray(acc).astype(value.dtype)
            continue
        if cfg.aggregation != "mean":
            out[name] = _robust_per_row(cfg, name, value, updates, num_classes)
            continue
        total = np.zeros(value.shape, dtype=np.float64)
        weight = np.zeros(value.shape[0], dtype=np.float64)
        for task, arrays, w in updates:
            rows = task_rows(cfg, name, value, int(task), num_classes)
            total[rows] += float(w) * np.asarray(arrays[name], dtype=np.float64)[rows]
            weight[rows] += float(w)
        trained = weight > 0
        merged = value.copy()
        merged[trained] = (total[trained] / weight[trained].reshape((-1,) + (1,) * (value.ndim - 1))).astype(value.dtype)
        out[name] = merged
    return out


def _robust_per_row(cfg: ExperimentConfig, name: str, value: np.ndarray,
                    updates: list[tuple[int, Mapping[str, np.ndarray], float]], num_classes: int) -> np.ndarray:
    """Median / trimmed mean per row over the replies whose task owns the row (rows grouped by
    the set of replies that trained them); untrained rows keep ``value``."""
    owners = np.zeros((value.shape[0], len(updates)), dtype=bool)
    for i, (task, _, _) in enumerate(updates):
        owners[task_rows(cfg, name, value, int(task), num_classes), i] = True
    merged = value.copy()
    for pattern in np.unique(owners[owners.any(axis=1)], axis=0):
        rows = np.flatnonzero((owners == pattern).all(axis=1))
        idx = np.flatnonzero(pattern)
        merged[rows] = combine([np.asarray(updates[i][1][name])[rows] for i in idx],
                               np.array([updates[i][2] for i in idx]), cfg.aggregation, cfg.trim_fraction)
    return merged
