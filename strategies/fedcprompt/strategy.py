"""Fed-CPrompt ("Fed-CPrompt: Contrastive Prompt for Rehearsal-Free Federated Continual Learning",
sections 2-3, Appendices C-D): asynchronous prompt learning + C2L.

Clients run CODA-P (decomposed prompts, task slices of the pool). While a client is on
task m it uses the server's slices of every *other known* task frozen -- past ones
(1..m-1) and future ones (m+1..n, learnt by clients that are ahead) -- and trains its
own slice and the head (eq. 2). Its loss is CE + lambda * C2L (eq. 3-4), see
``learner.py``.

The server averages *per task slice*: for every task m trained this round, slice m of
every prompt array (P, K, A of each prompted block) and the head rows of task m's
classes are the sample-weighted average over the clients that trained m; slices and
head rows nobody trained keep the server's values. When all clients are on the same
task (the platform's synchronous schedule) this equals FedAvg on what they trained.
The task a reply trained is the one the server assigned in that client's message
config (the platform's record of what it sent), never what the client claims.

Wire additions: every train message's config carries ``known-tasks`` (the number of
tasks whose slices the server has initialised), so a client knows which future
slices exist.
"""

from __future__ import annotations

from typing import Any

from flwr.app import ArrayRecord, RecordDict

from promptfcl.strategies.fedcprompt.options import FedCPromptOptions
from promptfcl.strategies.fedcprompt.prompt import FedCPromptPrompt
from promptfcl.strategies.fedcprompt.records import KNOWN_TASKS
from promptfcl.strategies.platform.rounds import Accepted, Sent
from promptfcl.strategies.platform.strategy import PromptStrategy


class FedCPromptStrategy(PromptStrategy):
    """Fed-CPrompt's server: FedAvg per task slice (in parallel over the tasks clients are on).

    Parameters
    ----------
    cfg : ExperimentConfig
        The run's configuration.
    num_classes : int
        Classes of the whole stream.
    options : FedCPromptOptions, optional
        ``fedcprompt.*`` options (the clients read the loss options).
    """

    name = "fedcprompt"
    prompt_class = FedCPromptPrompt
    options_class = FedCPromptOptions
    opts: FedCPromptOptions
    per_task = "always"  # slice m and task m's head rows over the clients that trained m, whatever the round

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.known_tasks = 0  # task slices initialised so far (0..known_tasks-1)

    # ------------------------------------------------------------------ hooks
    def on_task_start(self, task: int, arrays: ArrayRecord) -> ArrayRecord:
        self.known_tasks = max(self.known_tasks, task + 1)
        return super().on_task_start(task, arrays)

    def payload(self, sent: Sent, arrays: ArrayRecord) -> RecordDict:
        """The arrays, and how many task slices exist (a client uses the known future ones frozen)."""
        if sent.task >= self.known_tasks:
            raise RuntimeError(f"client {sent.client} assigned task {sent.task}, whose slice was never initialised "
                               f"(known tasks: {self.known_tasks}); call on_task_start first")
        sent.config[KNOWN_TASKS] = self.known_tasks
        return super().payload(sent, arrays)

    def round_metrics(self, accepted: list[Accepted]) -> dict[str, float]:
        return {"tasks-aggregated": len({a.task for a in accepted})}

    def state_dict(self) -> dict[str, Any]:
        return {"known-tasks": int(self.known_tasks)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.known_tasks = int(state.get("known-tasks", 0))


__all__ = ["FedCPromptOptions", "FedCPromptPrompt", "FedCPromptStrategy", "KNOWN_TASKS"]
