"""Every name promptfcl takes from Flower's internals, behind one door.

Flower's public API (``flwr.app``, ``flwr.serverapp``, ``flwr.clientapp``, ``flwr.simulation``,
``flwr.server.strategy``) does not offer these yet. Nothing else in the project imports them:
each is looked up here by :func:`internal`, with the public API that would replace it, so an
upgrade of Flower that removes or moves one fails with a message naming it, and
``tests/test_layers.py`` lists them all at once (one of the reasons ``flwr`` is pinned below
1.43 in pyproject.toml).
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple


class Internal(NamedTuple):
    module: str
    attribute: str
    used_for: str
    public_replacement: str


INTERNALS: dict[str, Internal] = {
    "run_simulation": Internal(
        "flwr.simulation.run_simulation", "_run_simulation",
        "promptfcl simulate: run ServerApp + ClientApp in Ray with a resolved run config and our Ray instance",
        "flwr.simulation.run_simulation takes no app directory, so nodes would get an empty run config; "
        "`flwr run` with a local SuperLink (make flwr-run) is the public path"),
    "simulation_exit_event": Internal(
        "flwr.supercore.telemetry", "EventType",
        "the exit event _run_simulation requires (telemetry is off)",
        "none needed once the public run_simulation takes an app directory"),
    "nested_objects": Internal(
        "flwr.supercore.inflatable.inflatable_object", "get_all_nested_objects",
        "bytes per message measured as Flower serialises them (common/records.py payload_bytes)",
        "a public per-message byte count (Message or RecordDict size)"),
    "object_id": Internal(
        "flwr.supercore.inflatable.inflatable_object", "get_object_id",
        "tests: identify message objects seen on the wire", "none (wire format is internal by nature)"),
    "object_type": Internal(
        "flwr.supercore.inflatable.inflatable_object", "get_object_type_from_object_content",
        "tests: check that only message objects cross the wire", "none (wire format is internal by nature)"),
    "inflate_object": Internal(
        "flwr.supercore.inflatable.inflatable_utils", "inflate_object_from_contents",
        "tests: decode messages recorded on the wire", "none (wire format is internal by nature)"),
    "pull_object_response": Internal("flwr.proto.message_pb2", "PullObjectResponse", "tests: wire decoding", "none"),
    "push_object_request": Internal("flwr.proto.message_pb2", "PushObjectRequest", "tests: wire decoding", "none"),
    "pull_messages_response": Internal("flwr.proto.fleet_pb2", "PullMessagesResponse", "tests: wire decoding", "none"),
    "push_messages_request": Internal("flwr.proto.fleet_pb2", "PushMessagesRequest", "tests: wire decoding", "none"),
    "get_fab_response": Internal("flwr.proto.fab_pb2", "GetFabResponse", "tests: the app bundle nodes fetch", "none"),
    "parse_config_args": Internal(
        "flwr.common.config", "parse_config_args",
        "python -m client.node_data check: read --node-config exactly as flower-supernode does",
        "a public parser of `--node-config` / `--run-config` strings"),
    "fused_run_config": Internal(
        "flwr.common.config", "get_fused_config_from_dir",
        "tests: the check the SuperLink applies to `flwr run -c` overrides (every key must be declared)",
        "a public run-config validator"),
    "task_identity": Internal(
        "flwr.supercore.task_identity", "TaskIdentity",
        "tests: a process identity, without which Message objects cannot be built outside a run",
        "Message construction that does not need a running task"),
    "superexec_main": Internal(
        "flwr.supercore.cli.flower_superexec", "flower_superexec",
        "promptfcl-superexec: Flower's own SuperExec command line, with the forking executor",
        "an executor option of flower-superexec"),
    "superexec_get_executor": Internal(
        "flwr.supercore.superexec.run_superexec", "get_executor",
        "promptfcl-superexec: replaced (replace_internal) so the SuperExec builds the forking executor",
        "an executor plug-in point of flower-superexec"),
    "subprocess_executor": Internal(
        "flwr.supercore.superexec.executor", "SubprocessExecutor",
        "the forking executor: Flower's stock path for other tasks and as the fallback", "none"),
    "launch_result": Internal(
        "flwr.supercore.superexec.executor", "LaunchResult", "the forking executor's answer to the SuperExec",
        "none"),
    "execution_spec": Internal(
        "flwr.supercore.superexec.executor", "ExecutionSpec", "tests: the task a SuperExec hands its executor",
        "none"),
    "task_type": Internal("flwr.supercore.constant", "TaskType", "the forking executor: which tasks fork", "none"),
    "executor_type": Internal("flwr.supercore.constant", "ExecutorType",
                              "promptfcl-superexec: which executor it replaces", "none"),
    "run_clientapp": Internal(
        "flwr.supernode.runtime.run_clientapp", "run_clientapp",
        "a forked ClientApp task runs Flower's own runner (what flwr-clientapp calls)",
        "a long-lived or forking ClientApp runner in Flower"),
    "resolve_root_certificates": Internal(
        "flwr.supercore.tls", "validate_and_resolve_root_certificates",
        "a forked ClientApp task reads the Runtime API's CA as flwr-clientapp does", "none"),
    "pull_message_objects": Internal(
        "flwr.supercore.inflatable.inflatable_utils", "pull_and_inflate_object_from_tree",
        "a forked ClientApp task asks for its message's objects sooner than Flower's 1 s first retry "
        "(client/zygote.py)", "a retry-interval setting of the ClientApp runner"),
    "supernode_main": Internal(
        "flwr.supernode.cli", "flower_supernode",
        "deploy/supernode.py: start the SuperNode with shorter waits", "a poll-interval option of flower-supernode"),
    "supernode_loop_time": Internal(
        "flwr.supernode.start_client_internal", "time",
        "deploy/supernode.py: the SuperNode loop's fixed 3 s idle wait and 0.5 s local waits, shortened",
        "a poll-interval option of flower-supernode"),
    "node_public_key_header": Internal(
        "flwr.supercore.constant", "FLEET_HTTP_PUBLIC_KEY_HEADER",
        "deploy/superlink.py: a node-facing request without node authentication is refused before its body is read",
        "node authentication ahead of the body in Flower's Fleet HTTP API"),
    "node_signature_header": Internal("flwr.supercore.constant", "FLEET_HTTP_SIGNATURE_HEADER",
                                      "deploy/superlink.py: as node_public_key_header", "as node_public_key_header"),
    "node_timestamp_header": Internal("flwr.common.constant", "TIMESTAMP_HEADER",
                                      "deploy/superlink.py: as node_public_key_header", "as node_public_key_header"),
    "timestamp_tolerance": Internal("flwr.common.constant", "TIMESTAMP_TOLERANCE",
                                    "deploy/superlink.py: the age of a signed timestamp Flower accepts",
                                    "as node_public_key_header"),
    "system_time_tolerance": Internal("flwr.common.constant", "SYSTEM_TIME_TOLERANCE",
                                      "deploy/superlink.py: the clock drift Flower allows",
                                      "as node_public_key_header"),
    "bytes_to_public_key": Internal("flwr.supercore.primitives.asymmetric", "bytes_to_public_key",
                                    "deploy/superlink.py: a node's public key as Flower reads it",
                                    "as node_public_key_header"),
    "verify_signature": Internal("flwr.supercore.primitives.asymmetric", "verify_signature",
                                 "deploy/superlink.py: a node's signed timestamp checked as Flower checks it",
                                 "as node_public_key_header"),
    "api_error_code": Internal("flwr.supercore.error", "ApiErrorCode",
                               "deploy/superlink.py: a refused activation answered as Flower answers one, so the "
                               "SuperNode prints why", "as node_public_key_header"),
    "node_status": Internal("flwr.supercore.constant", "NodeStatus",
                            "deploy/superlink.py: an identity still marked online is told from one that may activate",
                            "as node_public_key_header"),
    "sign_message": Internal("flwr.supercore.primitives.asymmetric", "sign_message",
                             "deploy/supernode.py: its rejoin probe signs as a SuperNode signs",
                             "as node_public_key_header"),
    "public_key_to_bytes": Internal("flwr.supercore.primitives.asymmetric", "public_key_to_bytes",
                                    "deploy/supernode.py: its rejoin probe sends the key as a SuperNode sends it",
                                    "as node_public_key_header"),
    "superlink_main": Internal(
        "flwr.superlink.cli", "flower_superlink",
        "deploy/superlink.py: start the SuperLink with a longer HTTP keep-alive",
        "a keep-alive option of flower-superlink"),
}


def internal(name: str) -> Any:
    """The Flower object registered as ``name`` in :data:`INTERNALS`.

    Raises
    ------
    ImportError
        Naming the missing module or attribute, what promptfcl uses it for, and what would replace it.
    """
    entry = INTERNALS[name]
    try:
        return getattr(importlib.import_module(entry.module), entry.attribute)
    except (ImportError, AttributeError) as exc:
        import flwr

        raise ImportError(
            f"Flower {getattr(flwr, '__version__', '?')} has no {entry.module}.{entry.attribute} "
            f"(promptfcl uses it for {entry.used_for}; public replacement: {entry.public_replacement}); "
            "see common/flower_internals.py") from exc


def replace_internal(name: str, value: Any) -> None:
    """Rebind the Flower name registered as ``name`` in its module (promptfcl-superexec's executor
    factory); raises like :func:`internal` when the installed Flower lacks it."""
    internal(name)
    entry = INTERNALS[name]
    setattr(importlib.import_module(entry.module), entry.attribute, value)


def set_internal_default(name: str, parameter: str, value: Any) -> None:
    """Change the default of ``parameter`` of the Flower function registered as ``name``, in
    this process (the zygote: for its forked tasks); raises ``ImportError`` as :func:`internal`
    does, and ``KeyError`` when the installed Flower's function has no such default."""
    fn = internal(name)
    if fn.__kwdefaults__ and parameter in fn.__kwdefaults__:
        fn.__kwdefaults__[parameter] = value
        return
    import inspect

    names = [p.name for p in inspect.signature(fn).parameters.values()
             if p.default is not inspect.Parameter.empty and p.kind != inspect.Parameter.KEYWORD_ONLY]
    if parameter not in names or fn.__defaults__ is None:
        raise KeyError(f"{INTERNALS[name].module}.{INTERNALS[name].attribute} has no default for {parameter!r}")
    defaults = list(fn.__defaults__)
    defaults[len(defaults) - len(names) + names.index(parameter)] = value
    fn.__defaults__ = tuple(defaults)


def missing_internals() -> list[str]:
    """Every registered name the installed Flower lacks (empty when all are there)."""
    missing = []
    for name in INTERNALS:
        try:
            internal(name)
        except ImportError as exc:
            missing.append(str(exc))
    return missing
