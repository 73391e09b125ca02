"""The platform every method builds on: Flower's Message-API FedAvg, made task-aware and sealed.

``PromptStrategy`` owns Flower's contract (``configure_train`` / ``aggregate_train``, and the
optional exchange before training): sampling, messages, every check of every reply, the
weights, per-task averaging and the round's records. A method fills hooks only, and cannot
override the contract (``__init_subclass__`` refuses), so no method checks, weighs or
averages replies its own way:

* ``setup()``  the method's own state, at the end of the platform's constructor (sealed)
* ``round_start(server_round, task, round_, arrays)``  before the round's messages are made
* ``payload(sent, arrays)``  one client's message content (default: the arrays and config);
  it may set ``sent.expected`` / ``sent.start`` / ``sent.data`` when the client gets its own
* ``check_records(reply, sent)``  the method's records of a reply the platform accepted
* ``aggregate(accepted)``  the round's arrays (default: the weighted average, per task slice
  when clients are on several tasks and ``per_task`` says so; ``averaging_weights`` and
  ``averaged_over_all`` adjust it)
* ``consolidate(server_round, arrays, accepted)``  a server step after averaging
* ``round_metrics(accepted)``  the method's figures for the round's record
* ``on_task_start`` / ``on_task_end``; ``uses_exchange`` / ``uses_task_end_exchange`` /
  ``exchange_payload`` / ``check_exchange`` / ``use_exchange`` (a query before training, Powder's
  measuring step, or at a task's end, LoRM's Gram pass: exchange.py);
  ``evaluation_pools``; ``state_dict`` / ``load_state_dict``; ``uploaded_features``, ``audit_notes``

Each accepted reply arrives as an :class:`~promptfcl.strategies.platform.rounds.Accepted`:
its message, the client and task the server sent, its weight. How replies are screened, weigh,
combine and how their statistics are bounded is the run's policy
(:mod:`~promptfcl.strategies.platform.policies`), not the method's. The server loop receives each
round as a value, :class:`~promptfcl.strategies.platform.outcome.RoundOutcome`
(``aggregate_round``; Flower's ``aggregate_train`` returns its arrays and metrics).
What of a run a method supports is declared on its options (``COMPATIBILITY``, ``check_run``)
and checked before anything loads (:mod:`~promptfcl.strategies.platform.run_checks`), not here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Self

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from ...common.config import sections as sections
from ...common.config.experiment import ExperimentConfig
from ...common.config.options import MethodOptions, NoOptions
from ...common.config.trust import resolve_trust
from ...common.data.schedule import task_schedule
from ...common.data.tasks import TaskLayout
from ...common.model.prompted import CodaPrompt
from ...common.model.runtime import Runtime
from ...common.model.trainable import ModuleShape, TrainableModule
from ...common.privacy import PrivacyOptions, PrivateRecord, privacy_options
from ...common.records import (
    ARRAYS,
    CONFIG,
    METRICS,
    PLACEMENT,
    array_views,
    as_float,
    as_int,
    metrics_of,
    to_array_record,
)
from ..registry import Declared
from .aggregation import average_replies
from .checks import NO_EXAMPLES, HeldSamples, SampleBounds, placement_of, platform_problem
from .exchange import ROUND, Exchanges
from .outcome import RoundOutcome
from .policies import run_policies
from .replies import REPLY_METRICS, MetricSpec
from .rounds import Accepted, Sent, SentRound
from .sampling import Sampling
from .statistics import Statistics

log = logging.getLogger("promptfcl")

#: Flower's contract, the platform's round logic and its constructor (a method's own state goes in
#: ``setup``): methods fill hooks instead
SEALED = frozenset({"__init__", "of", "configure_train", "aggregate_train", "aggregate_round", "configure_exchange",
                    "configure_task_end_exchange", "aggregate_exchange", "check_reply"})


class PromptStrategy(Sampling, Exchanges, FedAvg):
    """Sample-weighted FedAvg over prompt and head parameters, aware of the task schedule.

    Made by :meth:`of`; it takes what it reads, never the whole configuration: six sections, the
    ``layout`` (its classes size the head), ``privacy`` (``dp.*``), the ``method_settings`` a prompt
    module's ``configure`` reads and the ``config_digest`` every client's configuration must match.

    Parameters
    ----------
    options : MethodOptions or mapping, optional
        The method's options, parsed (``options_class``); a mapping of ``<method>.*`` keys
        (prefix removed) is parsed here, None gives the defaults.
    runtime : Runtime, optional
        The server's own data and backbone, where it has them (central evaluation).
    held : HeldSamples, optional
        What each virtual client holds, where the server has the data: every train reply's
        sample count is checked against it (the method's ``trained_examples`` of it).
    """

    # declared once, in the method's ``Method`` (its package's __init__.py), and read from there
    # (strategies/registry.py: ``Declared``); a method's class body does not repeat them
    #: the method's name (``strategy = "<name>"``)
    name: Declared[str] = Declared("name", "fedavg")
    #: the trainable module of this method (clients build their model with it; the server uses it to
    #: initialise task slices): common/model/trainable.py's protocol
    prompt_class: Declared[type[TrainableModule]] = Declared("prompt", CodaPrompt)
    #: the method's options dataclass (``from_options(dict)`` raises ConfigError on a bad value)
    options_class: Declared[type[MethodOptions]] = Declared("options", NoOptions)
    #: averaging with clients on several tasks in one round: "in-flight" averages each task's
    #: slice and head rows over the replies that trained it (Fed-CPrompt, Powder); "never":
    #: FedAvg-Prompt's plain average; "always": per task slice even with one task in the round
    per_task: str = "never"
    #: record names a train reply carries, exactly (None: "arrays" and "metrics" required,
    #: extra records allowed); methods that upload statistics list them here
    reply_records: frozenset[str] | None = frozenset({ARRAYS, METRICS})
    #: differential privacy (common/privacy.py): how each extra upload record is bounded (the
    #: ``arrays`` update always is); a record the client uploads and this does not name is refused
    private_records: Declared[dict[str, PrivateRecord]] = Declared("records", {})
    #: what each uploaded record of statistics holds (record name -> its arrays' kinds): the
    #: platform bounds them before the method sees them (``stats-bound``, where the run is
    #: defended; strategies/platform/statistics.py). Every record a reply or an exchange answer
    #: carries besides "arrays" and "metrics" is declared here.
    statistics: Declared[dict[str, Statistics]] = Declared("statistics", {})
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

    @classmethod
    def of(cls, cfg: ExperimentConfig, num_classes: int, options: Mapping[str, Any] | MethodOptions | None = None,
           runtime: Runtime | None = None, held: HeldSamples | None = None) -> Self:
        """The strategy of run ``cfg`` over ``num_classes`` classes (the one place it reads the whole)."""
        return cls(run=cfg.run, data=cfg.data, federation=cfg.federation, model=cfg.model,
                   robustness=cfg.robustness, placement=cfg.placement,
                   layout=TaskLayout.of(cfg.run, cfg.data, cfg.federation, cfg.model, num_classes),
                   privacy=privacy_options(cfg), method_settings=cfg.method, config_digest=cfg.digest(),
                   options=options, runtime=runtime, held=held)

    def __init__(self, *, run: sections.RunSection, data: sections.DataSection, federation: sections.FederationSection,
                 model: sections.ModelSection, robustness: sections.RobustnessSection,
                 placement: sections.PlacementSection, layout: TaskLayout,
                 privacy: PrivacyOptions, method_settings: Mapping[str, Any], config_digest: str,
                 options: Mapping[str, Any] | MethodOptions | None = None, runtime: Runtime | None = None,
                 held: HeldSamples | None = None) -> None:
        # Sampling is ours (seeded, see sampling.py); Flower's fraction settings are unused.
        super().__init__(fraction_train=1.0, fraction_evaluate=1.0, min_train_nodes=1, min_available_nodes=1)
        self.run, self.data, self.federation, self.model = run, data, federation, model
        self.robustness, self.placement, self.privacy = robustness, placement, privacy
        self.method_settings, self.config_digest = method_settings, config_digest
        self.server_runtime = runtime  # the server's own data and backbone (central evaluation), or None
        self.layout, self.num_classes = layout, layout.num_classes  # the run's tasks, classes, pool and head
        self.opts = self.parse_options(options)
        nodes = federation.population == "nodes"
        self.bounds = SampleBounds(nodes=nodes) if held is None else SampleBounds(
            max_examples=held.total, nodes=nodes,
            examples_of=lambda client, task, round_: self.trained_examples(held.of(client, task, round_)))
        self.schedule = task_schedule(data, federation, run.seed)  # that the method can follow it: checked early
        self.trust = resolve_trust(robustness.defences, federation.population, robustness.fault)
        self.policies = run_policies(robustness, self.trust.defended, privacy.noise_multiplier, federation)
        self.round_arrays: ArrayRecord | None = None  # the arrays this round started from
        self._sent_round = SentRound()  # this round's train messages
        self._exchange_round = SentRound()  # this round's exchange before training, or the task-end one
        self.exchange_phase = ROUND  # which of the two the exchange hooks answer (exchange.py)
        self._exchange_rejected: list[tuple[int, str]] = []  # (node id, reason) of its answers left out
        self._exchange_bounded = 0  # statistics rows of this round's exchange answers bounded
        self._exchange_ratios: dict[str, float] = {}  # per statistics array: largest row scale / its reference
        self._schedule_slots: dict[int, int] = {}  # client id -> its turn in the task schedule
        self._decoded: tuple[ArrayRecord | None, dict[str, np.ndarray]] = (None, {})
        self._warned_few_nodes = False
        self._nodes_ready = False  # population = "nodes": the first round has found its nodes
        self._node_names: dict[int, str] = {}  # registered names of the nodes seen (Sampling.connected_nodes)
        self.setup()

    # ------------------------------------------------------------------ hooks (defaults)
    def setup(self) -> None:
        """The method's own state, made once the platform's is (the sections, ``layout``, ``opts``...).
        A method never overrides ``__init__`` (sealed)."""

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
        """The round's arrays from the accepted replies: their average with the run's combiner, per
        task slice and head rows over the replies that trained each (``per_task``) when they trained
        several tasks, so a slice trained only by clients that are ahead is not diluted."""
        weights = self.averaging_weights(accepted)
        return average_replies([a.content.array_records[ARRAYS] for a in accepted], [a.task for a in accepted],
                               np.array([a.weight for a in accepted]) if weights is None else weights, self.per_task,
                               self.round_arrays, self.layout, self.policies.combiner,
                               self.averaged_over_all)

    def averaging_weights(self, accepted: list[Accepted]) -> np.ndarray | None:
        """Each reply's weight in the default ``aggregate`` (None: its ``Accepted.weight``, the run's
        weighting); a method whose paper averages otherwise (HePCo's uniform average) says so."""
        return None

    def averaged_over_all(self, name: str) -> bool:
        """Whether array ``name`` averages over every reply even with clients on several tasks (every
        reply trained all of it: HePCo's whole pool). Default: no, ``per_task`` decides."""
        return False

    def consolidate(self, server_round: int, arrays: ArrayRecord, accepted: list[Accepted]) -> ArrayRecord:
        """Server-side step after averaging (distillation, debiasing, ...). Default: none."""
        return arrays

    def round_metrics(self, accepted: list[Accepted]) -> dict[str, float]:
        """The method's own figures for the round's record (``strategy_metrics``)."""
        return {}

    def on_task_start(self, task: int, arrays: ArrayRecord) -> ArrayRecord:
        """Initialise the new task's prompt slice orthogonally to the earlier ones (CODA-P)."""
        state = array_views(arrays)  # read-only views: the prompt arrays are copied once, into the module
        prompt = self.prompt_from(state)
        gen = torch.Generator().manual_seed(int(np.random.default_rng([self.run.seed, task, 0x0A7]).integers(2**31)))
        prompt.init_task_slice(task, gen, orthogonal=self.model.ortho_init)
        state.update({f"prompt.{k}": v.numpy() for k, v in prompt.state_dict().items()})
        return to_array_record(state)

    def on_task_end(self, task: int, arrays: ArrayRecord) -> ArrayRecord:
        """Called after the last round of ``task``. Default: nothing to do."""
        return arrays

    def uses_exchange(self) -> bool:
        """Whether the round starts with an exchange (QUERY messages) before training."""
        return False

    def uses_task_end_exchange(self) -> bool:
        """Whether each task's end starts with an exchange (QUERY messages, the same hooks, with
        ``exchange_phase = "task-end"``) to the clients that trained it, before ``on_task_end``."""
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
                 self.name, self.clients_per_round, self.federation.num_clients, self.opts.to_dict() or "{}")
        log.info("task arrival: %s", self.schedule.describe())
        log.info("%s", self.trust.describe())

    # ------------------------------------------------------------------ Flower's contract (sealed)
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """One message per sampled client; ``config`` carries ``task``, ``round`` (and ``attempt``)."""
        self.round_arrays = arrays
        self.round_start(server_round, as_int(config["task"]), as_int(config["round"]), arrays)
        self._sent_round = self._send(server_round, arrays, config, grid, self.payload, MessageType.TRAIN)
        return self._sent_round.messages

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Flower's contract: the arrays and metrics of :meth:`aggregate_round`."""
        outcome = self.aggregate_round(server_round, replies)
        return outcome.arrays, outcome.metrics

    def aggregate_round(self, server_round: int, replies: Iterable[Message]) -> RoundOutcome:
        """Check every reply, screen, weigh and average the accepted ones, then the method's server
        step: the round's outcome, what the server loop records."""
        accepted, rejected, counts = self._accept(list(replies))
        rejected = self._exchange_rejected + rejected
        ratios = dict(self._exchange_ratios) if self.uses_exchange() else {}
        if not self._sent_round.sent and self._sent_round.skipped and self.round_arrays is not None:
            # the method left every sampled client out (its tasks are stopped): nothing to aggregate
            log.info("round %d: no client trains (the method left all %d sampled clients out); the global "
                     "model is unchanged", server_round, self._sent_round.skipped)
            return self._outcome(self.round_arrays, MetricRecord({"num-examples": 0, "clients": 0, "train-loss": 0.0}),
                                 accepted, rejected, counts, ratios)
        if len(accepted) < self.robustness.min_replies:
            log.warning("round %d: %d usable replies, fewer than min-replies = %d; the global model is unchanged",
                        server_round, len(accepted), self.robustness.min_replies)
            return self._outcome(None, None, accepted, rejected, counts, ratios)
        weights = self.policies.weighting([a.examples for a in accepted])
        for a, w in zip(accepted, weights):
            a.weight = float(w)
        self._log_capped(server_round, accepted, weights)
        counts["stats"] = self._exchange_bounded + self.policies.stats_bound.apply(accepted, self.statistics, ratios)
        if any(counts.values()):  # one line a round, not one per node
            log.info("round %d defences: %s; %d replies kept", server_round, ", ".join(f"{k} {v}" if k != "stats" else
                     f"{v} statistics rows bounded" for k, v in counts.items() if v), len(accepted))
        arrays = self.consolidate(server_round, self.aggregate(accepted), accepted)
        losses = [as_float(metrics_of(a.content)["train-loss"]) for a in accepted]
        metrics = MetricRecord({"num-examples": sum(a.examples for a in accepted), "clients": len(accepted),
                                "train-loss": float(np.average(losses, weights=weights))})
        for key, value in self.round_metrics(accepted).items():
            metrics[key] = value
        return self._outcome(arrays, metrics, accepted, rejected, counts, ratios)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """Evaluation is the server loop's (central, or federated by its own messages)."""
        return []

    # ------------------------------------------------------------------ replies
    def _accept(self, replies: list[Message]) -> tuple[list[Accepted], list[tuple[int, str]], dict[str, int]]:
        """The replies that pass every check (platform's, then the method's), then the run's update
        screen (:mod:`~promptfcl.strategies.platform.screens`; inactive where the run is not
        defended); the rejected ones as (node id, reason), logged; the replies per defence."""
        rejected: list[tuple[int, str]] = []
        kept: list[Accepted] = []
        for reply in replies:
            sent = self._sent_round.match(reply)
            reason = self._safely(self._problem, reply, sent)
            if reason is None and sent is not None:
                kept.append(Accepted(sent, reply))
            else:  # (a reply matching no message sent always has a reason: platform_problem)
                rejected.append(self._rejection(reply, reason or "no matching message sent this round"))
        accepted, excluded, counts = self.policies.screen_replies(kept, self._update_start)
        rejected += [self._rejection(a.reply, reason, level=logging.DEBUG) for a, reason in excluded]
        return accepted, rejected, counts

    def check_reply(self, reply: Message) -> str | None:
        """Why one reply to this round's training cannot be aggregated (None: it can), norms aside."""
        return self._safely(self._problem, reply, self._sent_round.match(reply, consume=False))

    def _problem(self, reply: Message, sent: Sent | None) -> str | None:
        expected = None if sent is None else (sent.expected if sent.expected is not None else sent.arrays)
        reason = platform_problem(reply, sent, expected, self.reply_records, self.reply_metrics, self.bounds,
                                  self.robustness.max_reply_bytes)
        if reason is not None or sent is None:  # no message matched: platform_problem said so
            return reason
        return self.check_records(reply, sent)

    @staticmethod
    def _safely(check: Callable[..., str | None], *args: Any) -> str | None:
        try:
            return check(*args)
        except Exception as exc:  # a check must never take the server down, whatever a reply holds
            return f"reply could not be checked ({type(exc).__name__}: {exc})"

    def _rejection(self, reply: Message, reason: str, level: int = logging.WARNING) -> tuple[int, str]:
        node = self._sent_round.sender(reply)
        log.log(logging.DEBUG if reason == NO_EXAMPLES else level, "reply from %s excluded: %s", self.node_label(node),
                reason)
        return node, reason

    def _update_start(self, sent: Sent) -> dict[str, np.ndarray] | None:
        """What a reply's update is measured from: ``sent.start``, else the arrays it must match
        (decoded once per round when everyone was sent the same)."""
        if sent.start is not None:
            return dict(sent.start)
        record = sent.expected if sent.expected is not None else sent.arrays
        if record is None:
            return None
        if self._decoded[0] is not record:  # read-only views of the sent bytes: nothing decoded twice
            self._decoded = (record, array_views(record))
        return self._decoded[1]

    def _outcome(self, arrays: ArrayRecord | None, metrics: MetricRecord | None, accepted: list[Accepted],
                 rejected: list[tuple[int, str]], counts: dict[str, int], ratios: dict[str, float]) -> RoundOutcome:
        """The round as a value: each accepted reply's share, node, norm, cosine and placement."""
        total = sum(a.weight for a in accepted)
        return RoundOutcome(
            arrays, metrics, tuple(accepted), tuple(rejected),
            shares=tuple(a.weight / total for a in accepted) if total > 0 else (),
            nodes=tuple(self.node_label(a.sent.node) for a in accepted), clients=tuple(a.sent.client for a in accepted),
            update_norms=tuple(a.update_norm for a in accepted), update_cosines=tuple(a.cosine for a in accepted),
            placements={a.reply.metadata.reply_to_message_id: placement_of(a.content) for a in accepted
                        if PLACEMENT in a.content},
            defences=dict(counts) if self.policies.defended else {}, stats_ratios=ratios,
            sample_rate=self._sent_round.sample_rate)

    def _log_capped(self, server_round: int, accepted: list[Accepted], weights: np.ndarray) -> None:
        """One line per node whose share max-client-weight cut: who claimed how much of the round."""
        counts = np.array([a.examples for a in accepted], dtype=np.float64)
        cap = self.policies.weighting.cap
        if cap <= 0 or counts.sum() <= 0 or weights.sum() <= 0:
            return
        for a, claimed, given in zip(accepted, counts / counts.sum(), weights / weights.sum()):
            if claimed > given + 1e-9:
                log.info("round %d: max-client-weight %g: %s claimed %.0f%% of the round's examples, weighted %.0f%%",
                         server_round, cap, self.node_label(a.sent.node), 100 * claimed, 100 * given)
    def prompt_from(self, state: Mapping[str, np.ndarray]) -> TrainableModule:
        """A prompt module holding (writable copies of) the prompt arrays of ``state`` (no backbone
        needed). Built on torch's meta device and given the copies, so the server holds the prompt
        once, not a freshly initialised one beside it."""
        dim = int(state["head.weight"].shape[1])
        arrays = {k[7:]: torch.from_numpy(np.array(v, copy=True)) for k, v in state.items() if k.startswith("prompt.")}

        def build() -> TrainableModule:
            prompt = self.prompt_class.of(ModuleShape(dim, tuple(self.model.layers), self.data.num_tasks,
                                                      self.model.pool_size, self.model.prompt_length))
            prompt.configure(self.method_settings)
            return prompt

        with torch.device("meta"):
            prompt = build()
        own = prompt.state_dict()
        if set(own) == set(arrays) and all(own[k].dtype == v.dtype for k, v in arrays.items()):
            prompt.load_state_dict(arrays, assign=True)
            if not any(t.is_meta for t in (*prompt.parameters(), *prompt.buffers())):
                return prompt
        prompt = build()  # a module with state outside its state dict: built as it is
        prompt.load_state_dict(arrays)
        return prompt

    # ------------------------------------------------------------------ checkpoint
    def platform_state(self) -> dict[str, Any]:
        """What the platform keeps across a resume (the nodes' declared sizes, each client's turn)."""
        return {"node-sizes": {str(k): list(v) for k, v in self.bounds.declared.items()},
                "schedule-slots": {str(k): int(v) for k, v in self._schedule_slots.items()},
                **self.policies.screen.to_dict()}  # each stateful screen's entry ("strikes", "norm-history"...)

    def load_platform_state(self, state: dict[str, Any]) -> None:
        self.bounds.declared = {int(k): (int(v[0]), int(v[1])) for k, v in state.get("node-sizes", {}).items()}
        self._schedule_slots = {int(k): int(v) for k, v in state.get("schedule-slots", {}).items()}
        self.policies.screen.load(state)

