"""Every name promptfcl takes from Flower's internals, behind one door.

Flower's public API (``flwr.app``, ``flwr.serverapp``, ``flwr.clientapp``, ``flwr.simulation``)
does not offer these yet. Nothing else in the project imports them: each is looked up here by
:func:`internal`, with what promptfcl relies on it to have (:attr:`Internal.uses`,
:attr:`Internal.read_by`) and the public API that would replace it, so an upgrade of Flower
that removes, moves or reshapes one fails with a message naming it, never a silent fallback;
``tests/test_layers.py`` checks them all at once. A name Flower is moving is looked up at its
new place first (:attr:`Internal.new_module`). Why ``flwr`` is pinned below 1.43, and what 1.43
changes for these names: docs/flower.md.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, NamedTuple

import flwr


class Internal(NamedTuple):
    """One Flower name promptfcl takes, and what it relies on that name to be.

    ``uses``: attributes, constructor or function parameters, or protobuf fields of the object
    that promptfcl reads or passes. ``read_by``: for a name promptfcl rebinds or whose default it
    changes, the function of the same module that must read it at call time, then the names
    that function's code must mention (default: the attribute); otherwise the change would be
    silently ignored. ``new_module``: where a newer Flower moves the name, tried before
    ``module`` so the same code runs on both (docs/flower.md).
    """

    module: str
    attribute: str
    used_for: str
    public_replacement: str
    uses: tuple[str, ...] = ()
    read_by: tuple[str, ...] = ()
    new_module: str = ""


INTERNALS: dict[str, Internal] = {
    "run_simulation": Internal(
        "flwr.simulation.run_simulation", "_run_simulation",
        "promptfcl simulate: run ServerApp + ClientApp in Ray with a resolved run config and our Ray instance",
        "flwr.simulation.run_simulation takes no app directory, so nodes would get an empty run config; "
        "`flwr run` with a local SuperLink (make flwr-run) is the public path",
        uses=("num_supernodes", "client_app", "server_app", "backend_name", "backend_config", "server_app_context",
              "app_dir", "is_app", "verbose_logging", "exit_event")),
    "simulation_exit_event": Internal(
        "flwr.supercore.telemetry", "EventType",
        "the exit event _run_simulation requires (telemetry is off)",
        "none needed once the public run_simulation takes an app directory",
        uses=("PYTHON_API_RUN_SIMULATION_LEAVE",)),
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
    "push_messages_request": Internal(
        "flwr.proto.fleet_pb2", "PushMessagesRequest",
        "deploy/fleet_rules.py: every message a node pushes is read (its sender, what it answers) before Flower "
        "stores it; tests: wire decoding", "a per-message sender check in Flower's Fleet API",
        uses=("node", "messages_list", "message_object_trees")),
    "get_fab_response": Internal("flwr.proto.fab_pb2", "GetFabResponse", "tests: the app bundle nodes fetch", "none"),
    "linkstate_factories": Internal(
        "flwr.superlink.config_loader", "get_objectstore_linkstate_factories",
        "tests: a real SuperLink state (state.db) for the node-facing gate, in process", "none"),
    "federation_manager": Internal("flwr.superlink.config_loader", "get_federation_manager",
                                   "tests: as linkstate_factories", "none"),
    "noop_federation_id": Internal("flwr.supercore.constant", "NOOP_FEDERATION_ID",
                                   "tests: the federation of a run in a real SuperLink state", "none"),
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
        "an executor plug-in point of flower-superexec", read_by=("run_superexec",)),
    "subprocess_executor": Internal(
        "flwr.supercore.superexec.executor", "SubprocessExecutor",
        "the forking executor: Flower's stock path for other tasks and as the fallback", "none",
        uses=("launch", "get_eligible_capacity", "wait_for_capacity", "reconcile", "close")),
    "launch_result": Internal(
        "flwr.supercore.superexec.executor", "LaunchResult", "the forking executor's answer to the SuperExec",
        "none", uses=("accepted",)),
    "execution_spec": Internal(
        "flwr.supercore.superexec.executor", "ExecutionSpec", "the task a SuperExec hands its executor",
        "none", uses=("task_type", "runtime_api_address", "token", "insecure", "root_certificates_path",
                      "runtime_dependency_install", "parent_pid", "suppress_output", "task_id")),
    "task_type": Internal("flwr.supercore.constant", "TaskType", "the forking executor: which tasks fork", "none",
                          uses=("CLIENT_APP", "SERVER_APP")),
    "executor_type": Internal("flwr.supercore.constant", "ExecutorType",
                              "promptfcl-superexec: which executor it replaces", "none", uses=("SUBPROCESS",)),
    "run_clientapp": Internal(
        "flwr.supernode.runtime.run_clientapp", "run_clientapp",
        "a forked ClientApp task runs Flower's own runner (what flwr-clientapp calls)",
        "a long-lived or forking ClientApp runner in Flower",
        uses=("runtime_api_address", "token", "insecure", "certificates", "parent_pid", "runtime_dependency_install")),
    "clientapp_main": Internal(
        "flwr.supernode.cli", "flwr_clientapp",
        "promptfcl bench deploy: the imports of Flower's own `flwr-clientapp` process, timed", "none"),
    "resolve_root_certificates": Internal(
        "flwr.supercore.tls", "validate_and_resolve_root_certificates",
        "a forked ClientApp task reads the Runtime API's CA as flwr-clientapp does", "none"),
    "pull_message_objects": Internal(
        "flwr.supercore.inflatable.inflatable_utils", "pull_and_inflate_object_from_tree",
        "a forked ClientApp task asks for its message's objects sooner than Flower's 1 s first retry "
        "(client/zygote.py)", "a retry-interval setting of the ClientApp runner", uses=("initial_backoff",)),
    "supernode_main": Internal(
        "flwr.supernode.cli", "flower_supernode",
        "deploy/supernode.py: start the SuperNode with shorter waits", "a poll-interval option of flower-supernode"),
    "supernode_loop_time": Internal(
        "flwr.supernode.start_client_internal", "time",
        "deploy/supernode.py: the SuperNode loop's fixed 3 s idle wait and 0.5 s local waits, shortened",
        "a poll-interval option of flower-supernode", read_by=("start_client_internal", "time", "sleep")),
    "node_public_key_header": Internal(
        "flwr.supercore.constant", "FLEET_HTTP_PUBLIC_KEY_HEADER",
        "deploy/fleet_gate.py: a node-facing request without node authentication is refused before its body is read",
        "node authentication ahead of the body in Flower's Fleet HTTP API"),
    "node_signature_header": Internal("flwr.supercore.constant", "FLEET_HTTP_SIGNATURE_HEADER",
                                      "deploy/fleet_gate.py: as node_public_key_header", "as node_public_key_header"),
    "node_timestamp_header": Internal("flwr.common.constant", "TIMESTAMP_HEADER",
                                      "deploy/fleet_gate.py: as node_public_key_header", "as node_public_key_header"),
    "timestamp_tolerance": Internal("flwr.common.constant", "TIMESTAMP_TOLERANCE",
                                    "deploy/fleet_gate.py: the age of a signed timestamp Flower accepts",
                                    "as node_public_key_header"),
    "system_time_tolerance": Internal("flwr.common.constant", "SYSTEM_TIME_TOLERANCE",
                                      "deploy/fleet_gate.py: the clock drift Flower allows",
                                      "as node_public_key_header"),
    "bytes_to_public_key": Internal("flwr.supercore.primitives.asymmetric", "bytes_to_public_key",
                                    "deploy/fleet_gate.py: a node's public key as Flower reads it",
                                    "as node_public_key_header"),
    "verify_signature": Internal("flwr.supercore.primitives.asymmetric", "verify_signature",
                                 "deploy/fleet_gate.py: a node's signed timestamp checked as Flower checks it",
                                 "as node_public_key_header"),
    "api_error_code": Internal("flwr.supercore.error", "ApiErrorCode",
                               "deploy/fleet_gate.py: a refused activation answered as Flower answers one, so the "
                               "SuperNode prints why", "as node_public_key_header",
                               uses=("FLEET_NODE_ACTIVATION_FAILED",)),
    "node_status": Internal("flwr.supercore.constant", "NodeStatus",
                            "deploy/fleet_rules.py: an identity still marked online is told from one that may activate",
                            "as node_public_key_header", uses=("ONLINE",)),
    "superlink_app": Internal("flwr.superlink.main", "create_app",
                              "deploy/fleet_gate.py: the SuperLink's state, which its app keeps as "
                              "app.state.linkstate_factory", "as node_public_key_header",
                              read_by=("create_app", "linkstate_factory")),
    "linkstate_factory": Internal("flwr.server.superlink.linkstate", "LinkStateFactory",
                                  "deploy/fleet_gate.py: the SuperLink's state", "as node_public_key_header",
                                  uses=("state",)),
    "linkstate": Internal("flwr.server.superlink.linkstate", "LinkState",
                          "deploy/fleet_gate.py, fleet_rules.py: which node a key is, whether it is still online, "
                          "and marking a crashed node's ended session offline so that it rejoins at once",
                          "as node_public_key_header",
                          uses=("get_node_info", "get_node_id_by_public_key", "deactivate_node")),
    "sql_linkstate": Internal("flwr.server.superlink.linkstate", "SqlLinkState",
                              "deploy/fleet_rules.py: the node a pushed reply's message was sent to (the "
                              "SuperLink's state.db, what start-server.sh runs)",
                              "a per-message sender check in Flower's Fleet API",
                              uses=("get_valid_message_ins",)),
    "superlink_node_id": Internal("flwr.common.constant", "SUPERLINK_NODE_ID",
                                  "the SuperLink's own node id: the gate refuses a node's message claiming it; the "
                                  "ServerApp tells the SuperLink's reports on a dead node from forged ones",
                                  "a public constant (flwr.app) for the SuperLink's node id"),
    "heartbeat_patience": Internal("flwr.common.constant", "HEARTBEAT_PATIENCE",
                                   "deploy/fleet_rules.py: when a node's last heartbeat was (its online-until, less "
                                   "this many intervals)", "a last-heartbeat time in NodeInfo"),
    "heartbeat_call_timeout": Internal("flwr.common.constant", "HEARTBEAT_CALL_TIMEOUT",
                                       "deploy/fleet_rules.py: the longest gap a live SuperNode leaves between "
                                       "heartbeats", "a last-heartbeat time in NodeInfo"),
    "heartbeat_base_multiplier": Internal("flwr.common.constant", "HEARTBEAT_BASE_MULTIPLIER",
                                          "deploy/fleet_rules.py: as heartbeat_call_timeout",
                                          "as heartbeat_call_timeout"),
    "heartbeat_random_range": Internal("flwr.common.constant", "HEARTBEAT_RANDOM_RANGE",
                                       "deploy/fleet_rules.py: as heartbeat_call_timeout",
                                       "as heartbeat_call_timeout"),
    "heartbeat_min_interval": Internal("flwr.common.constant", "HEARTBEAT_MIN_INTERVAL",
                                       "deploy/supernode.py: the shortest heartbeat interval the SuperLink accepts",
                                       "a heartbeat-interval option of flower-supernode"),
    "heartbeat_max_interval": Internal("flwr.common.constant", "HEARTBEAT_MAX_INTERVAL",
                                       "deploy/supernode.py: the longest heartbeat interval the SuperLink accepts",
                                       "a heartbeat-interval option of flower-supernode"),
    "supernode_heartbeat_interval": Internal(
        "flwr.supernode.fleet_http_connection", "HEARTBEAT_DEFAULT_INTERVAL",
        "deploy/supernode.py: the heartbeat interval a SuperNode declares (shorter: a crashed node rejoins sooner)",
        "a heartbeat-interval option of flower-supernode", read_by=("http_request_response",)),
    "heartbeat_sender_interval": Internal(
        "flwr.supercore.heartbeat", "HEARTBEAT_DEFAULT_INTERVAL",
        "deploy/supernode.py: how often the SuperNode's heartbeat thread sends (kept equal to what it declares)",
        "a heartbeat-interval option of flower-supernode", read_by=("HeartbeatSender._run",)),
    "max_concurrent_object_pushes": Internal(
        "flwr.supercore.constant", "FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PUSHES",
        "deploy/fleet_gate.py: the object pushes a SuperNode makes at once, the most the gate lets one node make",
        "as node_public_key_header"),
    "node_info": Internal("flwr.proto.node_pb2", "NodeInfo",
                          "deploy/fleet_rules.py: a node's status, name, key, heartbeat interval and deadline",
                          "as node_public_key_header",
                          uses=("status", "online_until", "heartbeat_interval", "name", "public_key")),
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
    "superlink_uvicorn": Internal(
        "flwr.superlink.cli.flower_superlink", "uvicorn",
        "deploy/superlink.py: the uvicorn.run Flower's SuperLink calls, replaced to serve a second listener",
        "a keep-alive and listener option of flower-superlink", uses=("run",),
        read_by=("_run_superlink_http_api", "uvicorn", "run")),
    # Flower's legacy strategy helpers: robust aggregation (strategies/platform/replies.py). Flower
    # moves its legacy leftovers into flwr.compat (1.43); the new place is tried first.
    "aggregate_median": Internal(
        "flwr.server.strategy.aggregate", "aggregate_median",
        "aggregation = \"median\": the coordinate-wise median of prompts and head",
        "a robust aggregation function of the Message API", new_module="flwr.compat.server.strategy.aggregate"),
    "aggregate_trimmed_avg": Internal(
        "flwr.server.strategy.aggregate", "aggregate_trimmed_avg",
        "aggregation = \"trimmed-mean\": the trimmed mean of prompts and head",
        "a robust aggregation function of the Message API", new_module="flwr.compat.server.strategy.aggregate"),
    "aggregate_krum": Internal(
        "flwr.server.strategy.aggregate", "aggregate_krum",
        "aggregation = \"krum\" / \"multikrum\" and Bulyan's selection (strategies/platform/byzantine.py)",
        "a robust aggregation function of the Message API", uses=("results", "num_malicious", "to_keep"),
        new_module="flwr.compat.server.strategy.aggregate"),
    "aggregate_bulyan": Internal(
        "flwr.server.strategy.aggregate", "aggregate_bulyan",
        "aggregation = \"bulyan\": Flower's Bulyan over Krum (strategies/platform/byzantine.py)",
        "a robust aggregation function of the Message API", uses=("results", "num_malicious", "aggregation_rule"),
        new_module="flwr.compat.server.strategy.aggregate"),
}


def _found(entry: Internal) -> tuple[Any, Any]:
    """The module holding ``entry`` (its new place first) and the object; raises ImportError or
    AttributeError from the old place when neither has it."""
    if entry.new_module:
        try:
            module = importlib.import_module(entry.new_module)
            return module, getattr(module, entry.attribute)
        except (ImportError, AttributeError):
            pass  # not moved in the installed Flower: the old place below
    module = importlib.import_module(entry.module)
    return module, getattr(module, entry.attribute)


def _missing(name: str, exc: BaseException | None = None, what: str = "") -> ImportError:
    entry = INTERNALS[name]
    where = entry.module + (f" (or {entry.new_module})" if entry.new_module else "")
    error = ImportError(
        f"Flower {getattr(flwr, '__version__', '?')} has no {where}.{entry.attribute}{what} "
        f"(promptfcl uses it for {entry.used_for}; public replacement: {entry.public_replacement}); "
        "see common/flower_internals.py")
    error.__cause__ = exc
    return error


def internal(name: str) -> Any:
    """The Flower object registered as ``name`` in :data:`INTERNALS`.

    Raises
    ------
    ImportError
        Naming the missing module or attribute, what promptfcl uses it for, and what would replace it.
    """
    try:
        return _found(INTERNALS[name])[1]
    except (ImportError, AttributeError) as exc:
        raise _missing(name, exc) from exc


def replace_internal(name: str, value: Any) -> None:
    """Rebind the Flower name registered as ``name`` in the module that holds it (promptfcl-superexec's
    executor factory, the SuperNode loop's ``time``); raises like :func:`internal` when the
    installed Flower lacks it or no longer reads it where :attr:`Internal.read_by` says."""
    problems = check(name)
    if problems:
        raise ImportError(problems[0])
    setattr(_found(INTERNALS[name])[0], INTERNALS[name].attribute, value)


def set_internal_default(name: str, parameter: str, value: Any) -> None:
    """Change the default of ``parameter`` of the Flower function registered as ``name``, in
    this process (the zygote: for its forked tasks); raises ``ImportError`` as :func:`internal`
    does, and ``KeyError`` when the installed Flower's function has no such default."""
    fn = internal(name)
    if fn.__kwdefaults__ and parameter in fn.__kwdefaults__:
        fn.__kwdefaults__[parameter] = value
        return
    names = [p.name for p in inspect.signature(fn).parameters.values()
             if p.default is not inspect.Parameter.empty and p.kind != inspect.Parameter.KEYWORD_ONLY]
    if parameter not in names or fn.__defaults__ is None:
        raise KeyError(f"{INTERNALS[name].module}.{INTERNALS[name].attribute} has no default for {parameter!r}")
    defaults = list(fn.__defaults__)
    defaults[len(defaults) - len(names) + names.index(parameter)] = value
    fn.__defaults__ = tuple(defaults)


def _has(obj: Any, name: str) -> bool:
    """Whether ``obj`` has ``name`` as an attribute, a parameter, or a protobuf field."""
    if hasattr(obj, name):
        return True
    fields = getattr(getattr(obj, "DESCRIPTOR", None), "fields_by_name", None)
    if fields is not None and name in fields:
        return True
    if callable(obj):
        try:
            return name in inspect.signature(obj).parameters
        except (TypeError, ValueError):  # a builtin without a signature
            return False
    return False


def _mentions(code: Any) -> set[str]:
    """Every global, attribute and method name a function's code (its nested functions included) uses."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _mentions(const)
    return names


def check(name: str) -> list[str]:
    """What the installed Flower lacks of what promptfcl relies on for ``name`` (empty: nothing):
    the name itself, each of :attr:`Internal.uses`, and :attr:`Internal.read_by`."""
    entry = INTERNALS[name]
    try:
        module, obj = _found(entry)
    except (ImportError, AttributeError) as exc:
        return [str(_missing(name, exc))]
    problems = [str(_missing(name, what=f".{use}")) for use in entry.uses if not _has(obj, use)]
    if entry.read_by:
        reader: Any = module
        for part in entry.read_by[0].split("."):  # a function, or a class's method (Class.method)
            reader = getattr(reader, part, None)
        reader = inspect.unwrap(reader) if callable(reader) else reader  # a decorated function's own code
        wanted = entry.read_by[1:] or (entry.attribute,)
        code = getattr(reader, "__code__", None)
        if code is None or not set(wanted) <= _mentions(code):
            problems.append(str(_missing(name, what=f" read by {entry.module}.{entry.read_by[0]} "
                                                    f"(through {', '.join(wanted)}), so changing it has no effect")))
    return problems


def missing_internals() -> list[str]:
    """Every registered name the installed Flower lacks, or lacks part of (empty when all are there)."""
    return [problem for name in INTERNALS for problem in check(name)]
