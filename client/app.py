"""The ClientApp: local training on the task and client share the server assigns.

A message may start a fresh process (deployment) or reuse a long-lived one (Ray
simulation); the runtime (data, backbone, query cache) is cached per process and
configuration, so reuse is free and a fresh start rebuilds only what it must.
"""

from __future__ import annotations

import logging

from flwr.app import ConfigRecord, Context, Message
from flwr.clientapp import ClientApp

from client import faults
from client.learner import read_task_round
from common.config import ExperimentConfig
from common.records import CONFIG
from common.runtime import get_runtime
from strategies import learner_class, prompt_class

log = logging.getLogger("promptfcl")

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Load the global prompts and head, train on this client's share, reply the update."""
    cfg = ExperimentConfig.from_run_config(context.run_config)
    check_same_config(cfg, msg.content[CONFIG])
    runtime = get_runtime(cfg, prompt_class(cfg.strategy))
    learner = learner_class(cfg.strategy)(runtime, cfg.method_options(cfg.strategy))
    task, round_, client_id = read_task_round(msg.content[CONFIG])
    faults.before_training(cfg, client_id, task, round_)
    reply = learner.fit(msg.content, task, round_, client_id)
    reply = faults.corrupt_reply(cfg, reply, client_id, task, round_)
    return Message(content=reply, reply_to=msg)


def check_same_config(cfg: ExperimentConfig, config: ConfigRecord) -> None:
    """Refuse to train under a configuration other than the server's."""
    theirs = config.get("config-digest")
    if theirs is not None and theirs != cfg.digest():
        raise ValueError(
            f"this client's run config (digest {cfg.digest()}) differs from the server's ({theirs}); "
            "both sides must run the same promptfcl configuration"
        )
