"""The platform every method builds on: Flower's Message-API FedAvg, made task-aware and sealed.

``PromptStrategy`` owns Flower's contract (``configure_train`` / ``aggregate_train``, and the
optional exchange before training): sampling, messages, every check of every reply, the
weights, per-task averaging and the round's records. A method fills hooks only, and cannot
override the contract (``__init_subclass__`` refuses), so no method checks, weighs or
averages replies its own way:

* ``round_start(server_round, task, round_, arrays)``  before the round's messages are made
* ``payload(sent, arrays)``  one client's message content (default: the arrays and config);
  it may set ``sent.expected`` / ``sent.start`` / ``sent.data`` when the client gets its own
* ``check_records(reply, sent)``  the method's records of a reply the platform accepted
* ``aggregate(accepted)``  the round's arrays (default: the weighted average, per task slice
  when clients are on several tasks and ``per_task`` says so)
* ``consolidate(server_round, arrays, accepted)``  a server step after averaging
* ``round_metrics(accepted)``  the method's figures for the round's record
* ``on_task_start`` / ``on_task_end``; ``uses_exchange`` / ``exchange_payload`` /
  ``check_exchange`` / ``use_exchange`` (a query before training, Powder's measuring step);
  ``evaluation_pools``; ``state_dict`` / ``load_state_dict``; ``uploaded_features``, ``audit_notes``

Each accepted reply arrives as an :class:`~promptfcl.strategies.platform.rounds.Accepted`:
its message, the client and task the server sent, its weight. How replies weigh and combine
is the run's policy (:mod:`~promptfcl.strategies.platform.aggregation`), not the method's.
What of a run a method supports is declared on its options (``COMPATIBILITY``, ``check_run``)
and checked before anything loads (:mod:`~promptfcl.strategies.platform.run_checks`), not here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from ...common.config import ExperimentConfig
from ...common.model import CodaPrompt
from ...common.options import MethodOptions, NoOptions
from ...common.privacy import PrivateRecord, privacy_options
from ...common.records import ARRAYS, CONFIG, METRICS, PLACEMENT, from_array_record, to_array_record
from ...common.schedule import task_schedule
from ...common.tasks import TaskLayout
from ...common.trust import resolve_trust
from .aggregation import aggregate_per_task, aggregation_policies, combine_records
from .checks import NO_EXAMPLES, SampleBounds, platform_problem
from .defences import update_screen
from .replies import REPLY_METRICS, MetricSpec, clipped_update, update_norm, update_of
from .rounds import Accepted, Sent, SentRound
from .sampling import Sampling
from .statistics import Statistics, StatisticsBound

log = logging.getLogger("promptfcl")

#: Flower's contract and the platform's round logic: methods fill hooks instead
SEALED = frozenset({"configure_train", "aggregate_train", "configure_exchange", "aggregate_exchange", "accept",
                    "check_reply"})


class PromptStrategy(Sampling, FedAvg):
    """Sample-weighted FedAvg over prompt and head parameters, aware of the task schedule.

    Parameters
    ----------
    cfg : ExperimentConfig
        The run's configuration (sampling, seed, prompt sizes).
    num_classes : int
        Classes of the whole stream (size of the head).
    options : MethodOptions or mapping, optional
        The method's options, parsed (``options_class``); a mapping of ``<method>.*`` keys
        (prefix removed) is parsed here, None gives the defaults.
    """

    name = "fedavg"
    #: prompt module of this method (clients build their model with it; the server uses it to
    #: initialise task slices). Must take CodaPrompt's constructor arguments.
    prompt_class: type[CodaPrompt] = CodaPrompt
    #: the method's options dataclass (``from_options(dict)`` raises ConfigError on a bad value)
    options_class: type[MethodOptions] = NoOptions
    #: averaging with clients on several tasks in one round: "in-flight" averages each task's
    #: slice and head rows over the replies that trained it (Fed-CPrompt, Powder); "never":
    #: FedAvg-Prompt's plain average; "always": per task slice even with one task in the round
    per_task: str = "never"
    #: record names a train reply carries, exactly (None: "arrays" and "metrics" required,
    #: extra records allowed); methods that upload statistics list them here
    reply_records: frozenset[str] | None = frozenset({ARRAYS, METRICS})
    #: differential privacy (common/privacy.py): how each extra upload record is bounded (the
    #: ``arrays`` update always is); a record the client uploads and this does not name is refused
    private_records: dict[str, PrivateRecord] = {}
    #: what each uploaded record of statistics holds (record name -> its arrays' kinds): the
    #: platform bounds them before the method sees them (``stats-bound``, where the run is
    #: defended; strategies/platform/statistics.py). Every record a reply or an exchange answer
    #: carries besides "arrays" and "metrics" is declared here.
    statistics: dict[str, Statistics] = {}
    #: the fields a train reply's metrics record may hold (strategies/platform/replies.py)
    reply_metrics: dict[str, MetricSpec] = REPLY_METRICS

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        overridden = SEALED & set(vars(cls))
        if overridden:
            raise TypeError(f"{cls.__name__} overrides {sorted(overridden)}: the platform owns Flower's contract "
                            "and the reply checks; fill the hooks instead (strategies/platform/strategy.py)")

    @classmethod
    def parse_options(cls, options: Mapping[str, Any] | MethodOptions | None) -> MethodOptions:
        """The method's typed options (ConfigError on unknown keys or bad values)."""
        if isinstance(options, MethodOptions):
            return options
        return cls.options_class.from_options(options or {})

    def __init__(self, cfg: ExperimentConfig, num_classes: int,
                 options: Mapping[str, Any] | MethodOptions | None = None) -> None:
        # Sampling is ours (seeded, see sampling.py); Flower's fraction settings are unused.
        super().__init__(fraction_train=1.0, fraction_evaluate=1.0, min_train_nodes=1, min_available_nodes=1)
        self.cfg = cfg
        self.num_classes = num_classes
        self.layout = TaskLayout.of(cfg, num_classes)  # the run's tasks, classes, pool and head
        self.opts = self.parse_options(options)
        self.weighting, self.combiner = aggregation_policies(cfg)
        self.bounds = SampleBounds(nodes=cfg.population == "nodes")
        self.schedule = task_schedule(cfg)  # that the method can follow it: checked before any loading
        self.trust = resolve_trust(cfg.defences, cfg.population, cfg.fault)
        self.screen = update_screen(self.trust.defended, cfg.update_norm_factor, cfg.max_update_norm,
                                    cfg.update_clip, cfg.update_min_cosine, cfg.update_reversed_norm,
                                    cfg.update_strikes, privacy_options(cfg).noise_multiplier)
        self.stats_bound = StatisticsBound(cfg.stats_bound if self.trust.defended else 0.0)
        self.defence_counts: dict[str, int] = {}  # the last aggregation's replies excluded or clipped per defence
        self.sent_round = SentRound()  # this round's train messages
        self.exchange_round = SentRound()  # this round's exchange before training
        self.round_arrays: ArrayRecord | None = None  # the arrays this round started from
        self.rejected: list[tuple[int, str]] = []  # (node id, reason) of the last aggregation
        self.exchange_rejected: list[tuple[int, str]] = []
        self.exchange_bounded = 0  # statistics rows of this round's exchange answers bounded
        self.stats_ratios: dict[str, float] = {}  # per statistics array: largest row scale / the round's reference
        self.accepted: list[Accepted] = []  # the last aggregation's accepted replies
        self.placements: dict[str, dict[str, str]] = {}  # reply-to message id -> where an accepted reply trained
        self.schedule_slots: dict[int, int] = {}  # client id -> its turn in the task schedule
        self._decoded: tuple[ArrayRecord | None, dict[str, np.ndarray]] = (None, {})
        self._warned_few_nodes = False
        self._nodes_ready = False  # population = "nodes": the first round has found its nodes
        self.last_sample_rate = self.sample_rate  # the last sampling's sampled / population (Sampling)
        self.node_names: dict[int, str] = {}  # registered names of the nodes seen (Sampling.connected_nodes)

    # ------------------------------------------------------------------ hooks (defaults)
    def round_start(self, server_round: int, task: int, round_: int, arrays: ArrayRecord) -> None:
        """Before the round's messages are made (``task``, ``round_``: the nominal ones)."""

    def payload(self, sent: Sent, arrays: ArrayRecord) -> RecordDict | None:
        """One client's message content. Methods add records or send a subset of the arrays
        (then set ``sent.expected``: what the reply must hold). None: the client does not train
        this round (a method that has stopped its task, Fed-CPrompt's task-level early stopping);
        a round whose every sampled client is left out keeps the global arrays unchanged."""
        return RecordDict({ARRAYS: arrays, CONFIG: sent.config})

    def check_records(self, reply: Message, sent: Sent) -> str | None:
        """Why the method cannot use a reply the platform accepted (None: it can)."""
        return None

    def aggregate(self, accepted: list[Accepted]) -> ArrayRecord:
        """The round's arrays from the accepted replies: their weighted average (:meth:`average`)."""
        return self.average(accepted, np.array([a.weight for a in accepted]))

    def consolidate(self, server_round: int, arrays: ArrayRecord, accepted: list[Accepted]) -> ArrayRecord:
        """Server-side step after averaging (distillation, debiasing, ...). Default: none."""
        return arrays

    def round_metrics(self, accepted: list[Accepted]) -> dict[str, float]:
        """The method's own figures for the round's record (``strategy_metrics``)."""
        return {}

    def on_task_start(self, task: int, arrays: ArrayRecord) -> ArrayRecord:
        """Initialise the new task's prompt slice orthogonally to the earlier ones (CODA-P)."""
        state = from_array_record(arrays)
        prompt = self.prompt_from(state)
        gen = torch.Generator().manual_seed(int(np.random.default_rng([self.cfg.seed, task, 0x0A7]).integers(2**31)))
        prompt.init_task_slice(task, gen, orthogonal=self.cfg.ortho_init)
        state.update({f"prompt.{k}": v.numpy() for k, v in prompt.state_dict().items()})
        return to_array_record(state)

    def on_task_end(self, task: int, arrays: ArrayRecord) -> ArrayRecord:
        """Called after the last round of ``task``. Default: nothing to do."""
        return arrays

    def uses_exchange(self) -> bool:
        """Whether the round starts with an exchange (QUERY messages) before training."""
        return False

    def exchange_payload(self, sent: Sent, arrays: ArrayRecord) -> RecordDict | None:
        """One sampled client's exchange message (None: that client gets none)."""
        return None

    def check_exchange(self, reply: Message, sent: Sent) -> str | None:
        """Why an answer to the exchange cannot be used (None: it can)."""
        return None

    def use_exchange(self, server_round: int, answers: list[Accepted]) -> None:
        """Use the exchange's accepted answers (before the round's training messages are made)."""

    def evaluation_pools(self, arrays: ArrayRecord, upto: int) -> tuple[ArrayRecord, dict[int, list[int]]] | None:
        """How to score tasks 0..``upto``: None scores the global ``arrays`` once for all tasks; else
        (arrays, {task: its prompt slices}) scores each task with its own slices."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """Strategy state a checkpoint must hold (NumPy arrays and plain values)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""

    def trained_examples(self, held: int) -> int:
        """How many of the ``held`` samples a client's share holds it trains on, and so reports as
        ``num-examples`` (its FedAvg weight). Default: all; a method whose clients hold some out
        for validation (Fed-CPrompt) says fewer."""
        return held

    def reference_components(self) -> int:
        """Prompt components per prompted block of the single-task reference of the transfer
        metrics (random tasks, server/transfer.py); default: one task's slice."""
        return self.layout.components_per_task

    def stateful_parameters(self, arrays: ArrayRecord) -> int | dict[str, int] | None:
        """Parameters one client exchange would carry each way if clients kept what they already
        hold between rounds (for comparing with a paper that counts it so): one count for both
        directions, or a dict (``s2c``, ``c2s`` and any other named part, e.g. HGP's
        ``c2s-statistics``) where they differ; None: the same as what is sent."""
        return None

    def uploaded_features(self, classes: list[int], seed: int) -> list[dict[str, Any]] | None:
        """Feature vectors clients uploaded of ``classes`` (what the privacy audit inverts): dicts
        with ``class``, ``kind``, ``vector`` (D,), ``client`` and ``meta``; None: none uploaded."""
        return None

    def audit_notes(self) -> dict[str, Any]:
        """What else the server's state shows of the clients, for the privacy audit's report."""
        return {}

    def summary(self) -> None:
        log.info("strategy %s: %s clients per round out of %d, options %s",
                 self.name, self.clients_per_round, self.cfg.num_clients, self.opts.to_dict() or "{}")
        log.info("task arrival: %s", self.schedule.describe())
        log.info("%s", self.trust.describe())

    # ------------------------------------------------------------------ Flower's contract (sealed)
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """One message per sampled client; ``config`` carries ``task``, ``round`` (and ``attempt``)."""
        self.round_arrays = arrays
        self.round_start(server_round, int(config["task"]), int(config["round"]), arrays)
        self.sent_round = self._send(server_round, arrays, config, grid, self.payload, MessageType.TRAIN)
        return self.sent_round.messages

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Check every reply, weigh and average the accepted ones, then the method's server step."""
        self.accepted = self.accept(list(replies))
        self.rejected = self.exchange_rejected + self.rejected
        if not self.sent_round.sent and self.sent_round.skipped and self.round_arrays is not None:
            # the method left every sampled client out (its tasks are stopped): nothing to aggregate
            log.info("round %d: no client trains (the method left all %d sampled clients out); the global "
                     "model is unchanged", server_round, self.sent_round.skipped)
            return self.round_arrays, MetricRecord({"num-examples": 0, "clients": 0, "train-loss": 0.0})
        if len(self.accepted) < self.cfg.min_replies:
            log.warning("round %d: %d usable replies, fewer than min-replies = %d; the global model is unchanged",
                        server_round, len(self.accepted), self.cfg.min_replies)
            return None, None
        weights = self.weighting([a.examples for a in self.accepted])
        for a, w in zip(self.accepted, weights):
            a.weight = float(w)
        self._log_capped(server_round, weights)
        self.stats_ratios = self.stats_ratios if self.uses_exchange() else {}
        self.defence_counts["stats"] = self.exchange_bounded + self.stats_bound.apply(
            self.accepted, self.statistics, self.stats_ratios)
        if any(self.defence_counts.values()):  # one line a round, not one per node
            log.info("round %d defences: %s; %d replies kept", server_round, ", ".join(f"{k} {v}" if k != "stats" else
                     f"{v} statistics rows bounded" for k, v in self.defence_counts.items() if v), len(self.accepted))
        arrays = self.consolidate(server_round, self.aggregate(self.accepted), self.accepted)
        losses = [float(a.content[METRICS]["train-loss"]) for a in self.accepted]
        metrics = MetricRecord({"num-examples": sum(a.examples for a in self.accepted),
                                "clients": len(self.accepted),
                                "train-loss": float(np.average(losses, weights=weights))})
        for key, value in self.round_metrics(self.accepted).items():
            metrics[key] = value
        return arrays, metrics

    def configure_exchange(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> list[Message]:
        """The exchange before training (QUERY messages to the round's sampled clients), if the method has one."""
        self.exchange_round, self.exchange_rejected, self.exchange_bounded = SentRound(), [], 0
        if not self.uses_exchange():
            return []
        self.round_arrays = arrays
        self.round_start(server_round, int(config["task"]), int(config["round"]), arrays)
        self.exchange_round = self._send(server_round, arrays, config, grid, self.exchange_payload, MessageType.QUERY)
        return self.exchange_round.messages

    def aggregate_exchange(self, server_round: int, replies: list[Message]) -> None:
        """Check the exchange's answers (``check_exchange``) and hand the good ones to ``use_exchange``."""
        answers = []
        for reply in replies:
            sent = self.exchange_round.match(reply)
            if reply.has_error():
                reason: str | None = f"client error: {reply.error.reason}"
            elif sent is None:
                reason = "cannot tell which message this reply answers (no matching message sent this round)"
            else:
                reason = self._safely(self.check_exchange, reply, sent)
            if reason is None:
                answers.append(Accepted(sent, reply))  # type: ignore[arg-type]
                continue
            node = self.exchange_round.sender(reply)
            self.exchange_rejected.append((node, "exchange: " + reason))
            log.warning("exchange reply from %s excluded: %s", self.node_label(node), reason)
        self.stats_ratios = {}
        self.exchange_bounded = self.stats_bound.apply(answers, self.statistics, self.stats_ratios)
        self.use_exchange(server_round, answers)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """Evaluation is the server loop's (central, or federated by its own messages)."""
        return []

    # ------------------------------------------------------------------ replies
    def accept(self, replies: list[Message]) -> list[Accepted]:
        """The replies that pass every check (platform's, then the method's), then the run's update
        defences (:mod:`~promptfcl.strategies.platform.defences`; none where the run is not defended).
        Rejected replies are logged and listed in ``rejected``; ``defence_counts`` counts per defence.
        """
        self.rejected, self.placements = [], {}
        kept: list[Accepted] = []
        for reply in replies:
            sent = self.sent_round.match(reply)
            reason = self._safely(self._problem, reply, sent)
            if reason is None:
                kept.append(Accepted(sent, reply))  # type: ignore[arg-type]
            else:
                self._reject(reply, reason)
        # each reply's change from what it was sent, computed once for every screen
        updates = [update_of(from_array_record(a.content[ARRAYS]), self.update_start(a.sent)) for a in kept]
        norms = [update_norm(u, None) for u in updates]
        screening = self.screen(updates, norms, [a.task for a in kept], [a.sent.client for a in kept])
        accepted = []
        for i, a in enumerate(kept):
            a.update_norm, a.cosine = norms[i], screening.cosines[i]
            if i in screening.excluded:
                self._reject(a.reply, screening.excluded[i][1], level=logging.DEBUG)
                continue
            if i in screening.scales:  # norm bounding: shortened, its direction kept
                a.content[ARRAYS] = to_array_record(clipped_update(
                    from_array_record(a.content[ARRAYS]), self.update_start(a.sent), screening.scales[i]))
                a.update_norm = norms[i] * screening.scales[i]
            accepted.append(a)
            if PLACEMENT in a.content:
                self.placements[a.reply.metadata.reply_to_message_id] = dict(a.content[PLACEMENT])
        self.defence_counts = screening.counts()
        return accepted

    def check_reply(self, reply: Message) -> str | None:
        """Why one reply to this round's training cannot be aggregated (None: it can), norms aside."""
        return self._safely(self._problem, reply, self.sent_round.match(reply, consume=False))

    def _problem(self, reply: Message, sent: Sent | None) -> str | None:
        expected = None if sent is None else (sent.expected if sent.expected is not None else sent.arrays)
        reason = platform_problem(reply, sent, expected, self.reply_records, self.reply_metrics, self.bounds,
                                  self.cfg.max_reply_bytes)
        return reason if reason is not None else self.check_records(reply, sent)  # type: ignore[arg-type]

    @staticmethod
    def _safely(check: Callable[..., str | None], *args: Any) -> str | None:
        try:
            return check(*args)
        except Exception as exc:  # a check must never take the server down, whatever a reply holds
            return f"reply could not be checked ({type(exc).__name__}: {exc})"

    def _reject(self, reply: Message, reason: str, level: int = logging.WARNING) -> None:
        node = self.sent_round.sender(reply)
        self.rejected.append((node, reason))
        log.log(logging.DEBUG if reason == NO_EXAMPLES else level, "reply from %s excluded: %s", self.node_label(node),
                reason)

    def update_start(self, sent: Sent) -> dict[str, np.ndarray] | None:
        """What a reply's update is measured from: ``sent.start``, else the arrays it must match
        (decoded once per round when everyone was sent the same)."""
        if sent.start is not None:
            return dict(sent.start)
        record = sent.expected if sent.expected is not None else sent.arrays
        if record is None:
            return None
        if self._decoded[0] is not record:
            self._decoded = (record, from_array_record(record))
        return self._decoded[1]

    @property
    def reply_shares(self) -> list[float]:
        """Each accepted reply's share of the round's weight (the round's record)."""
        total = sum(a.weight for a in self.accepted)
        return [a.weight / total for a in self.accepted] if total > 0 else []

    @property
    def reply_nodes(self) -> list[str]:
        """Each accepted reply's node, named (aligned with :attr:`reply_shares`)."""
        return [self.node_label(a.sent.node) for a in self.accepted]

    def _log_capped(self, server_round: int, weights: np.ndarray) -> None:
        """One line per node whose share max-client-weight cut: who claimed how much of the round."""
        counts = np.array([a.examples for a in self.accepted], dtype=np.float64)
        if self.weighting.cap <= 0 or counts.sum() <= 0 or weights.sum() <= 0:
            return
        for a, claimed, given in zip(self.accepted, counts / counts.sum(), weights / weights.sum()):
            if claimed > given + 1e-9:
                log.info("round %d: max-client-weight %g: %s claimed %.0f%% of the round's examples, weighted %.0f%%",
                         server_round, self.weighting.cap, self.node_label(a.sent.node), 100 * claimed, 100 * given)

    @property
    def update_norms(self) -> list[float]:
        return [a.update_norm for a in self.accepted]

    @property
    def update_cosines(self) -> list[float | None]:
        """Each accepted reply's cosine with its task's median update (None: fewer than 3 on its task)."""
        return [a.cosine for a in self.accepted]

    # ------------------------------------------------------------------ averaging (the default aggregate)
    def average(self, accepted: Sequence[Accepted], weights: np.ndarray,
                arrays: Sequence[ArrayRecord] | None = None) -> ArrayRecord:
        """The accepted replies' arrays (or ``arrays``, one per reply: a method that completes
        partial replies first) combined with ``weights`` (the run's combiner); per task slice and
        head rows over the replies that trained each (``per_task``) when they trained several
        tasks, so a slice trained only by clients that are ahead is not diluted."""
        records = list(arrays) if arrays is not None else [a.content.array_records[ARRAYS] for a in accepted]
        tasks = [a.task for a in accepted]
        per_task = self.per_task == "always" or (self.per_task == "in-flight" and len(set(tasks)) > 1)
        if per_task and self.round_arrays is not None:
            updates = [(t, from_array_record(r), float(w)) for t, r, w in zip(tasks, records, weights)]
            return to_array_record(aggregate_per_task(self.cfg, from_array_record(self.round_arrays), updates,
                                                      self.num_classes, self.combiner))
        return combine_records(records, weights, self.combiner)

    def placement_of(self, message: Message) -> dict[str, Any]:
        """``message``'s client and where its accepted reply trained (None where unknown or rejected)."""
        config = message.content.config_records[CONFIG] if CONFIG in message.content.config_records else ConfigRecord()
        where = self.placements.get(message.metadata.message_id, {})
        return {"client": int(config["client-id"]) if "client-id" in config else None,
                "node": where.get("node"), "device": where.get("device"),
                "cuda_visible_devices": where.get("cuda-visible-devices"),
                "config_digest": where.get("config-digest")}

    def prompt_from(self, state: Mapping[str, np.ndarray]) -> CodaPrompt:
        """A prompt module holding the prompt arrays of ``state`` (no backbone needed)."""
        dim = int(state["head.weight"].shape[1])
        prompt = self.prompt_class(dim, self.cfg.layers, self.cfg.pool_size, self.cfg.prompt_length,
                                   self.cfg.num_tasks)
        prompt.configure(self.cfg)
        prompt.load_state_dict({k[7:]: torch.from_numpy(np.array(v, copy=True))
                                for k, v in state.items() if k.startswith("prompt.")})
        return prompt

    # ------------------------------------------------------------------ checkpoint
    def platform_state(self) -> dict[str, Any]:
        """What the platform keeps across a resume (the nodes' declared sizes, each client's turn)."""
        return {"node-sizes": {str(k): list(v) for k, v in self.bounds.declared.items()},
                "schedule-slots": {str(k): int(v) for k, v in self.schedule_slots.items()},
                "strikes": self.screen.strikes.to_dict()}

    def load_platform_state(self, state: dict[str, Any]) -> None:
        self.bounds.declared = {int(k): (int(v[0]), int(v[1])) for k, v in state.get("node-sizes", {}).items()}
        self.schedule_slots = {int(k): int(v) for k, v in state.get("schedule-slots", {}).items()}
        self.screen.strikes.load(state.get("strikes", {}))
