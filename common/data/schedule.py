"""Task arrival: which task each client is on in each round.

Every client walks the same class-incremental stream (task 0, 1, ..., N-1) at its own
pace. Every ``switch-every`` rounds (K) a ``switch-fraction`` (f) of the clients moves
to its next task (Powder, section 5.1: every 3 rounds, 40 %; Fed-CPrompt,
Fed-CPrompt Appendix D.3: half of the clients one task ahead of the others). The movers
are taken in turn from a seeded permutation of the clients, so the fastest and slowest
client are never more than one task apart and every client has moved after 1/f switches.

The synchronous stream is the special case K = rounds-per-task (R), f = 1: every client
moves to task r // R at round r. With K = R * f the slowest clients leave task j exactly
at the end of round (j + 1) R, as in the synchronous stream, and the fastest ones
started it R - K rounds earlier.

``RandomTaskSchedule`` is Powder's benchmark (Powder, section 5.1, ``task-generator =
random``): each client starts on a task of its own, and every K rounds a random f of the
clients switch to a new task of their own; tasks are numbered in the order they start.

Everything here is a pure function of (configuration, client, round): the server stores
no schedule state, and a resumed run recomputes exactly the same assignment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from ..errors import ConfigError

if TYPE_CHECKING:  # config validates through this module; no import back at run time
    from ..config.sections import DataSection, FederationSection


def check_switching(switch_every: int, switch_fraction: float, zero_means: str) -> None:
    """The checks every schedule makes of ``switch-every`` (K) and ``switch-fraction`` (f)."""
    if not 0.0 < switch_fraction <= 1.0:
        raise ConfigError(f"switch-fraction must be in (0, 1], got {switch_fraction}")
    if switch_every < 0:
        raise ConfigError(f"switch-every must be >= 0 (0: {zero_means}), got {switch_every}")


def movers_per_switch(switch_fraction: float, num_clients: int) -> int:
    """Clients that move at each switch point: ceil(f C), at least one."""
    return max(1, math.ceil(switch_fraction * num_clients - 1e-9))


@dataclass(frozen=True)
class TaskSchedule:
    """Per-client task positions over the run's rounds.

    Parameters
    ----------
    num_tasks, num_clients, rounds_per_task : int
        The stream (N tasks), the population and the nominal rounds per task (R); the
        run has N * R rounds.
    switch_every : int
        K, rounds between two switch points (0: R).
    switch_fraction : float
        f, share of the clients that moves at each switch point (1.0: all).
    seed : int
        Seeds the order in which clients take their turn.
    """

    num_tasks: int
    num_clients: int
    rounds_per_task: int
    switch_every: int = 0
    switch_fraction: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        check_switching(self.switch_every, self.switch_fraction, "rounds-per-task")
        slowest = self.position(self.slowest_client, self.total_rounds - 1)
        if slowest < self.num_tasks - 1:
            raise ConfigError(
                f"with switch-every = {self.every} and switch-fraction = {self.switch_fraction}, the slowest "
                f"client reaches only task {slowest + 1} of {self.num_tasks} in {self.total_rounds} rounds; "
                f"use switch-every <= rounds-per-task x switch-fraction "
                f"({self.rounds_per_task * self.switch_fraction:g})")

    # ------------------------------------------------------------------ shape
    @property
    def every(self) -> int:
        """K: rounds between switch points."""
        return self.switch_every or self.rounds_per_task

    @property
    def movers(self) -> int:
        """Clients that move at each switch point."""
        return movers_per_switch(self.switch_fraction, self.num_clients)

    @property
    def total_rounds(self) -> int:
        return self.num_tasks * self.rounds_per_task

    @property
    def synchronous(self) -> bool:
        return self.movers >= self.num_clients and self.every == self.rounds_per_task

    @cached_property
    def rank(self) -> np.ndarray:
        """Each client's turn in the order of moving (a seeded permutation; identity when synchronous)."""
        if self.movers >= self.num_clients:
            return np.arange(self.num_clients)
        order = np.random.default_rng([self.seed, 0x7A5C]).permutation(self.num_clients)
        rank = np.empty(self.num_clients, dtype=np.int64)
        rank[order] = np.arange(self.num_clients)
        return rank

    @property
    def slowest_client(self) -> int:
        return int(np.argmax(self.rank))

    # ------------------------------------------------------------------ positions
    def _moves(self, client: int, round_index: int) -> int:
        """Moves ``client`` has made by round ``round_index`` (0-based), uncapped."""
        switches = round_index // self.every  # switch points at rounds K, 2K, ... (<= round_index)
        slots = switches * self.movers  # turns handed out so far, cyclically over the ranks
        rank = int(self.rank[client])
        return 0 if slots <= rank else -(-(slots - rank) // self.num_clients)

    def position(self, client: int, round_index: int) -> int:
        """The task ``client`` trains in round ``round_index`` (0-based over the whole run)."""
        return min(self._moves(client, round_index), self.num_tasks - 1)

    def assignment(self, client: int, round_index: int) -> tuple[int, int]:
        """(task, rounds the client has already spent on it) for ``client`` in ``round_index``."""
        if not 0 <= client < self.num_clients:
            raise ValueError(f"client {client} outside the population of {self.num_clients}")
        task = self.position(client, round_index)
        if task == 0:
            return 0, round_index
        # the task-th move used turn (task-1) * C + rank, handed out at switch point turn // movers + 1
        turn = (task - 1) * self.num_clients + int(self.rank[client])
        entered = (turn // self.movers + 1) * self.every
        return task, round_index - entered

    def newest_task(self, round_index: int) -> int:
        """The furthest task any client is on in ``round_index`` (-1 before the first round)."""
        if round_index < 0:
            return -1
        fastest = int(np.argmin(self.rank))
        return self.position(fastest, round_index)

    def tasks_starting(self, round_index: int) -> list[int]:
        """Tasks some client begins for the first time in ``round_index`` (their slices need initialising)."""
        return list(range(self.newest_task(round_index - 1) + 1, self.newest_task(round_index) + 1))

    def steps(self) -> list[tuple[int, int]]:
        """(nominal task, round within it) of every round of the run: the server loop's order."""
        return [(r // self.rounds_per_task, r % self.rounds_per_task) for r in range(self.total_rounds)]

    def task_ending(self, round_index: int) -> int | None:
        """The nominal task that ends with ``round_index`` (its accuracy-matrix column), if any."""
        return round_index // self.rounds_per_task if round_index % self.rounds_per_task == self.rounds_per_task - 1 \
            else None

    def client_tasks(self, client: int, round_index: int) -> list[int]:
        """The tasks ``client`` has learnt or is learning in ``round_index``."""
        return list(range(self.position(client, round_index) + 1))

    def previous_task(self, task: int) -> int:
        """The task a client learnt before ``task`` (-1: none): every client walks the stream in order."""
        return task - 1

    def describe(self) -> str:
        if self.synchronous:
            return f"synchronous: all clients move to the next task every {self.rounds_per_task} rounds"
        return (f"asynchronous: every {self.every} rounds {self.movers} of {self.num_clients} clients move to "
                f"their next task (in a seeded turn order)")


@dataclass(frozen=True)
class RandomTaskSchedule:
    """Powder's asynchronous benchmark: every task belongs to one client (Powder, section 5.1).

    Client c starts on task c. At every switch point (rounds K, 2K, ... < num_rounds) a
    seeded random ``ceil(f C)`` of the clients switch to a new task each; new tasks are
    numbered in the order they start (at a switch point, by client id). So the run has
    ``C + S ceil(f C)`` tasks for S switch points, tasks last different numbers of rounds
    (at least K, except those still running at the end), and a client may switch at two
    points in a row or not at all.

    Parameters
    ----------
    num_tasks, num_clients, num_rounds : int
        Tasks (must equal the count above), clients and rounds of the run.
    switch_every : int
        K, rounds between switch points (0: no switches).
    switch_fraction : float
        f, share of the clients switching at each point (Powder: 0.4).
    seed : int
        Seeds who switches when.
    """

    num_tasks: int
    num_clients: int
    num_rounds: int
    switch_every: int = 3
    switch_fraction: float = 0.4
    seed: int = 0

    synchronous = False

    def __post_init__(self) -> None:
        check_switching(self.switch_every, self.switch_fraction, "no switches")
        needed = self.num_clients + len(self.switch_rounds) * self.movers
        if self.num_tasks != needed:
            raise ConfigError(
                f"task-generator = random: {self.num_clients} clients, {len(self.switch_rounds)} switch points "
                f"in {self.num_rounds} rounds and {self.movers} clients switching at each make {needed} tasks; "
                f"set num-tasks = {needed} (got {self.num_tasks})")

    @property
    def every(self) -> int:
        return self.switch_every

    @property
    def movers(self) -> int:
        return movers_per_switch(self.switch_fraction, self.num_clients)

    @property
    def total_rounds(self) -> int:
        return self.num_rounds

    @property
    def switch_rounds(self) -> list[int]:
        """Rounds (0-based) in which some clients start a new task."""
        return list(range(self.every, self.num_rounds, self.every)) if self.every else []

    @cached_property
    def _starts(self) -> tuple[np.ndarray, np.ndarray]:
        """(owner client, first round) of every task, in task order."""
        owner, start = list(range(self.num_clients)), [0] * self.num_clients
        for s, r in enumerate(self.switch_rounds, start=1):
            movers = np.random.default_rng([self.seed, s, 0x5E1EC7]).choice(self.num_clients, self.movers,
                                                                             replace=False)
            for c in sorted(movers.tolist()):
                owner.append(int(c))
                start.append(r)
        return np.asarray(owner), np.asarray(start)

    def owner(self, task: int) -> int:
        """The client that learns ``task``."""
        return int(self._starts[0][task])

    def start(self, task: int) -> int:
        """The first round (0-based) of ``task``."""
        return int(self._starts[1][task])

    def finish(self, task: int) -> int:
        """The last round in which ``task``'s client trains it."""
        owner, start = self._starts
        later = np.flatnonzero((owner == owner[task]) & (start > start[task]))
        return int(start[later[0]] - 1) if len(later) else self.num_rounds - 1

    def client_tasks(self, client: int, round_index: int) -> list[int]:
        """The tasks ``client`` has learnt or is learning in ``round_index``, in order."""
        owner, start = self._starts
        return np.flatnonzero((owner == client) & (start <= round_index)).tolist()

    def previous_task(self, task: int) -> int:
        """The task ``task``'s client learnt before it (-1: none)."""
        earlier = self.client_tasks(self.owner(task), self.start(task) - 1)
        return earlier[-1] if earlier else -1

    def assignment(self, client: int, round_index: int) -> tuple[int, int]:
        """(task, rounds the client has already spent on it) for ``client`` in ``round_index``."""
        if not 0 <= client < self.num_clients:
            raise ValueError(f"client {client} outside the population of {self.num_clients}")
        task = self.client_tasks(client, round_index)[-1]
        return task, round_index - self.start(task)

    def newest_task(self, round_index: int) -> int:
        if round_index < 0:
            return -1
        return int(np.flatnonzero(self._starts[1] <= round_index)[-1])

    def tasks_starting(self, round_index: int) -> list[int]:
        return np.flatnonzero(self._starts[1] == round_index).tolist()

    def steps(self) -> list[tuple[int, int]]:
        """(newest task, round) of every round: there are no nominal task ends."""
        return [(self.newest_task(r), r) for r in range(self.num_rounds)]

    def task_ending(self, round_index: int) -> int | None:
        return None

    def describe(self) -> str:
        switching = (f"every {self.every} rounds {self.movers} random clients switch to a new task"
                     if self.every else "no switches")
        return (f"random tasks: {self.num_tasks} tasks over {self.num_clients} clients, {switching} "
                f"({self.num_rounds} rounds)")


def task_schedule(data: DataSection, federation: FederationSection, seed: int) -> TaskSchedule | RandomTaskSchedule:
    """The run's schedule (raises ConfigError for settings that cannot work)."""
    if data.random:
        return RandomTaskSchedule(data.num_tasks, federation.num_clients, data.num_rounds, federation.switch_every,
                                  federation.switch_fraction, seed)
    if federation.centralised:  # one client holding all data: the upper bound sees the stream in order
        return TaskSchedule(data.num_tasks, 1, federation.rounds_per_task, seed=seed)
    return TaskSchedule(data.num_tasks, federation.num_clients, federation.rounds_per_task, federation.switch_every,
                        federation.switch_fraction, seed)


__all__ = ["RandomTaskSchedule", "TaskSchedule", "check_switching", "movers_per_switch", "task_schedule"]
