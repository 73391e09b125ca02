#!/usr/bin/env bash
# Submit a promptfcl run to a SuperLink and follow its log until it ends.
#
#   deploy/submit-run.sh --superlink HOST:PORT --ca certs/ca.crt [--config deploy/run.toml]
#                        [--set KEY=VALUE ...] [--app DIR] [--no-stream]
#   deploy/submit-run.sh --superlink HOST:PORT --insecure ...        (TLS off: test setups only)
#
#   --config FILE   run-config overrides (flat TOML; default deploy/run.toml: nodes with their
#                   own data, federated evaluation)
#   --set KEY=VAL   further overrides (TOML values: quote strings, e.g. --set out-dir='"runs/x"')
#   --app DIR       the Flower app to submit (default: this repository)
#   --no-stream     submit and return at once (follow later with `.venv/bin/flwr log RUN_ID promptfcl`;
#                   `flwr` is on PATH only with the venv active)
#
# The merged configuration is validated here first (unknown keys, bad values, a backbone
# beyond the server's token or memory ceiling, common/node/footprint.py, and weights or a backbone
# source that the nodes refuse to open, client/node_policy.py, stop before anything is sent).
# Results are written on the SuperLink machine, in its --state directory (or at out-dir if that
# is an absolute path). Exit status 0: the run completed; 1: it failed or was stopped (`flwr
# stop`), which the last line says, with the run id.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

superlink=""; ca=""; insecure=0; config="$DEPLOY_DIR/run.toml"; app="$REPO_DIR"; stream=1; sets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --superlink) superlink=$2; shift 2 ;;
    --ca) ca=$2; shift 2 ;;
    --insecure) insecure=1; shift ;;
    --config) config=$2; shift 2 ;;
    --set) sets+=("$2"); shift 2 ;;
    --app) app=$2; shift 2 ;;
    --no-stream) stream=0; shift ;;
    -h|--help) sed -n "2,$(( $(grep -n '^set -euo' "$0" | cut -d: -f1) - 1 ))p" "$0"; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done
[ -n "$superlink" ] || die "--superlink HOST:PORT is required"
if [ "$insecure" = 0 ]; then
  [ -n "$ca" ] || die "--ca certs/ca.crt is required (or --insecure for a test setup without TLS)"
  need_file "$ca" "CA certificate"
fi
need_file "$config" "run config"
need_file "$app/pyproject.toml" "Flower app"
config="$(abspath "$config")"

work=$(mktemp -d "${TMPDIR:-/tmp}/promptfcl-submit.XXXXXX")
trap 'rm -rf "$work"' EXIT
merged="$work/run.toml"  # `flwr run -c` recognises a file by its .toml suffix
# Merge --config and --set into one flat TOML file (`flwr run -c` takes a file or pairs, not both)
# and validate it with promptfcl's own configuration checks.
(cd "$REPO_DIR" && "$PYTHON" - "$config" "$merged" ${sets[@]+"${sets[@]}"}) <<'EOF'
import logging
import sys
from promptfcl.common.config.experiment import ConfigError, ExperimentConfig
from promptfcl.common.config.files import parse_overrides, toml_value
from promptfcl.common.node.footprint import check_server_footprint
from promptfcl.common.model.weights import BackboneSpec
from promptfcl.client.node_policy import NodePolicy, NodeRefusal
from promptfcl.server.cli import load_config

src, dst, *sets = sys.argv[1:]
try:
    cfg = load_config(src, sets, None, None)
    # what the ServerApp checks before it builds anything, checked before sending
    backbone = BackboneSpec.of(cfg.run, cfg.data, cfg.federation, cfg.model, cfg.caching)
    check_server_footprint(backbone, cfg.training.batch_size, cfg.model.prompt_length, cfg.model.image_size)
    wanted = load_config(src, [], None, None).to_dict()
    wanted.update(parse_overrides(sets))
except ConfigError as exc:
    sys.exit(f"error: {exc}")
# The nodes' own rule (client/node_policy.py): a deployed node never opens a weights file or a
# backbone source the run names. weights = "timm" is the paper configuration, which runs on nodes
# that chose a backbone of their own (deploy/README.md): asked of such a node, the others of a
# node started without one. Said once, here (not also as the node's log line).
logging.getLogger("promptfcl").addHandler(logging.NullHandler())
node = NodePolicy(limits={}, weights="timm" if cfg.model.weights == "timm" else None)
try:
    node.backbone_weights(cfg.model.backbone, cfg.model.weights)
except NodeRefusal as exc:
    sys.exit(f"error: the run was not submitted: {exc}. A deployed node never opens a weights file or backbone "
             "source the run names: one started with weights of its own (start-client.sh --node "
             "'weights=\"/srv/vit.pt\"' or \"timm\") uses those, any other refuses the run. Set the run's "
             "weights = \"pretrained:<source>\" (each node's cache: promptfcl pretrain) or \"random\", or "
             "\"timm\" for nodes that chose their own")
# only the keys the user set (the app's pyproject.toml holds the defaults)
defaults = ExperimentConfig().to_dict()
final = cfg.to_dict()
keys = [k for k in final if k in wanted and (k not in defaults or final[k] != defaults[k])]
with open(dst, "w") as fh:
    for k in keys:
        fh.write(f'"{k}" = {toml_value(final[k])}\n')
print(f"run config: {cfg.federation.population} population, {cfg.evaluation.evaluation} evaluation, "
      f"strategy {cfg.run.strategy}, "
      f"{cfg.data.num_tasks} tasks x {cfg.federation.rounds_per_task} rounds, {cfg.federation.num_clients} nodes", file=sys.stderr)
EOF

write_connection promptfcl "$superlink" "$ca" "$insecure"
args=("$app" promptfcl --run-config "$merged")
[ "$stream" = 1 ] && args+=(--stream)
log="$work/flwr-run.log"
flwr run "${args[@]}" 2>&1 | tee "$log"
[ "${PIPESTATUS[0]}" = 0 ] || die "flwr run failed (see above)"
run_id=$(sed -n 's/.*Successfully started run \([0-9]*\).*/\1/p' "$log" | head -1)
[ -n "$run_id" ] || die "the SuperLink did not start the run (see above)"
# the flwr this script ran (the venv's, which a plain shell does not have on PATH)
[ "$stream" = 1 ] || { echo "run $run_id submitted; follow it with: $(command -v flwr) log $run_id promptfcl"; exit 0; }
# `flwr run --stream` ends when the run does, with status 0 either way: ask the SuperLink how it ended.
# (fields split on \x1f, not on whitespace: an empty reason stays a field)
IFS=$'\x1f' read -r status details traffic < <(flwr list promptfcl --run-id "$run_id" --format json | "$PYTHON" -c '
import json, sys
run = json.load(sys.stdin)["runs"][0]
details = " ".join(str(run.get("status-details") or "").split())  # one line, "" for none
print(run["status"], "" if details == "N/A" else details, run.get("network-traffic", {}).get("total-bytes", "?"),
      sep="\x1f")') || die "cannot ask the SuperLink how run $run_id ended (flwr list promptfcl --run-id $run_id)"
echo "run $run_id: $status (SuperLink traffic: $traffic bytes)"
case "$status" in
  finished:completed*) exit 0 ;;
  finished:stopped*)
    # Flower records no reason for a stop request (`flwr stop`), only for its own stops
    why="by a stop request to the SuperLink's Control API (flwr stop $run_id promptfcl)"
    echo "error: run $run_id was stopped before it completed: ${details:-$why}" >&2
    exit 1 ;;
  *) why="the SuperLink gives no reason; the ServerApp's log is above"
     echo "error: run $run_id did not complete ($status): ${details:-$why}" >&2
     exit 1 ;;
esac
