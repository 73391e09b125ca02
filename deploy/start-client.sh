#!/usr/bin/env bash
# Start a SuperNode (one client) on this machine, with its own data, in the foreground.
#
#   deploy/start-client.sh --superlink HOST:PORT --ca ca.crt --key keys/node1
#                          --data-dir /path/to/images [--device auto|cuda|mps|cpu]
#                          [--config deploy/run.toml] [--set KEY=VALUE ...] [--state DIR] [--port 9094]
#   deploy/start-client.sh ... --partition-id I --num-partitions N --dataset NAME [--data-dir DIR]
#                                                  (a simulated share of the run's dataset, of which
#                                                   this node holds a copy)
#   deploy/start-client.sh ... --dataset fashion-mnist --data-dir DIR (another source held by this node)
#   deploy/start-client.sh ... --insecure                             (TLS off: test setups only)
#
#   --key FILE      this node's private key (deploy/make-node-key.sh); its .pub must be registered
#   --data-dir DIR  this node's images: DIR/<class>/*.png or DIR/{train,test}/<class>/*.png
#   --device        where the ClientApp computes (default auto: cuda, then mps, then cpu)
#   --config/--set  the run configuration the server will use (default deploy/run.toml); the node's
#                   data is checked against it (classes, number of nodes) before the node starts
#   --state DIR     this node's Flower state (installed app bundles); default ./supernode-state
#   --port          local port between the SuperNode and its ClientApp processes (one per node
#                   on a machine; default 9094)
#   --threads N     torch threads per ClientApp process (default: all cores)
#   --poll SECONDS  how often an idle node asks the SuperLink for work (default 1; Flower's
#                   SuperNode waits a fixed 3 s, which a round pays at its start; deploy/supernode.py)
#   --rejoin-timeout SECONDS
#                   a node restarted at once after a crash finds its identity still marked online
#                   at the SuperLink until its last heartbeat is older than a live node leaves
#                   (about 11 s at the default --heartbeat): the script says so and asks again
#                   every second, up to this long (default 300; 0: start at once and let the
#                   SuperNode fail). Still online after that means a live process holds it:
#                   another machine with a copy of this node's key
#   --heartbeat SECONDS
#                   the heartbeat interval this node declares (default 10, the shortest the
#                   SuperLink accepts; Flower's SuperNode declares 30): how soon a crash is known
#                   and the restarted node can rejoin (deploy/supernode.py)
#   --no-warm       Flower's stock SuperExec: a fresh interpreter per message. The default
#                   (Linux) is promptfcl-superexec beside a SuperNode in process isolation: every
#                   message still runs in a process of its own, forked from a warm zygote that has
#                   imported torch, Flower and promptfcl once (client/warm_executor.py)
#   --node KEY=VAL  more node-config (TOML values), this node's own rules (client/node_policy.py):
#                   max-image-size=512 (and max-batch-size, max-pool-size, max-prompt-length,
#                   max-num-classes, max-num-tasks, max-embed-dim, max-depth, max-num-heads,
#                   max-local-epochs, max-tokens, max-memory-gb: tokens per image and the
#                   backbone's estimated memory): refuse runs beyond these sizes;
#                   memory-budget-mb=1500: the memory a message may take on this node (MB); it
#                   plans its training within it (micro-batches, recomputed blocks; the same
#                   updates) or refuses; backbone-precision="int8" (or "bf16"): a lower-precision
#                   frozen backbone, this node's choice (docs/edge.md);
#                   fault-injection=true: obey the run's fault switch (robustness experiments);
#                   data-from-run=true: read the run's dataset location instead of this node's;
#                   weights="/srv/vit.pt" (or
#                   "timm", "pretrained:<source>"): this node's own backbone, whatever the run
#                   says (without it a run naming a weights file or "timm" is refused)
#
# The node refuses to start if its data is missing or does not match the run's classes.
# Caches (backbone weights, decoded images, backbone queries) live in $PROMPTFCL_CACHE
# (default ~/.cache/promptfcl): a new ClientApp process per message reuses them.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

superlink=""; ca=""; key=""; insecure=0; data_dir=""; dataset=""; pid=""; nparts=""; device=auto
config="$DEPLOY_DIR/run.toml"; sets=(); state=supernode-state; port=9094; threads=0; no_auth=0; extra=(); warm=1; poll=1
rejoin=300; heartbeat=10
while [ $# -gt 0 ]; do
  case "$1" in
    --superlink) superlink=$2; shift 2 ;;
    --ca) ca=$2; shift 2 ;;
    --key) key=$2; shift 2 ;;
    --no-node-auth) no_auth=1; shift ;;
    --insecure) insecure=1; shift ;;
    --data-dir) data_dir=$2; shift 2 ;;
    --dataset) dataset=$2; shift 2 ;;
    --partition-id) pid=$2; shift 2 ;;
    --num-partitions) nparts=$2; shift 2 ;;
    --device) device=$2; shift 2 ;;
    --config) config=$2; shift 2 ;;
    --set) sets+=("$2"); shift 2 ;;
    --state) state=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --node) extra+=("$2"); shift 2 ;;
    --no-warm) warm=0; shift ;;
    --poll) poll=$2; shift 2 ;;
    --rejoin-timeout) rejoin=$2; shift 2 ;;
    --heartbeat) heartbeat=$2; shift 2 ;;
    -h|--help) sed -n "2,$(( $(grep -n '^set -euo' "$0" | cut -d: -f1) - 1 ))p" "$0"; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done
[ -n "$superlink" ] || die "--superlink HOST:PORT is required"
case "$device" in auto|cpu|cuda|mps) ;; *) die "--device must be auto, cpu, cuda or mps" ;; esac
[[ "$threads" =~ ^[0-9]+$ ]] || die "--threads must be a number"
[[ "$poll" =~ ^[0-9]*\.?[0-9]+$ ]] || die "--poll must be a number of seconds"
[[ "$rejoin" =~ ^[0-9]+$ ]] || die "--rejoin-timeout must be a whole number of seconds"
[[ "$heartbeat" =~ ^[0-9]+$ ]] || die "--heartbeat must be a whole number of seconds"

# this node's data, as node-config (TOML values; strings quoted)
node_config="device=\"$device\""
[ "$threads" = 0 ] || node_config="$node_config threads=$threads"
if [ -n "$pid" ] || [ -n "$nparts" ]; then
  [[ "$pid" =~ ^[0-9]+$ && "$nparts" =~ ^[0-9]+$ ]] || die "--partition-id and --num-partitions must both be numbers"
  [ -n "$dataset" ] || die "a partition node names the dataset it holds a copy of: --dataset NAME (and --data-dir DIR where the source needs one)"
  node_config="$node_config partition-id=$pid num-partitions=$nparts"
else
  [ -n "$data_dir$dataset" ] || die "this node needs data: --data-dir DIR (or --dataset NAME, or --partition-id/--num-partitions)"
fi
if [ -n "$data_dir" ]; then
  [ -d "$data_dir" ] || die "data directory $data_dir does not exist"
  data_dir="$(cd "$data_dir" && pwd)"
  node_config="$node_config data-dir=\"$data_dir\""
fi
[ -z "$dataset" ] || node_config="$node_config dataset=\"$dataset\""
for kv in ${extra[@]+"${extra[@]}"}; do
  [[ "$kv" =~ ^[a-z-]+=[^[:space:]]+$ ]] || die "--node takes KEY=VALUE (TOML value, no spaces), got '$kv'"
  node_config="$node_config $kv"
done

args=(--superlink "$superlink" --port "$port" --node-config "$node_config")
if [ "$insecure" = 1 ]; then
  echo "WARNING: connecting WITHOUT TLS (--insecure): traffic is readable and forgeable" >&2
  args+=(--insecure)
else
  [ -n "$ca" ] || die "--ca ca.crt is required (the SuperLink's CA; --insecure only for test networks)"
  need_file "$ca" "CA certificate"
  args+=(--root-certificates "$(cd "$(dirname "$ca")" && pwd)/$(basename "$ca")")
fi
if [ "$no_auth" = 0 ]; then
  [ -n "$key" ] || die "--key FILE is required (deploy/make-node-key.sh; --no-node-auth if the SuperLink does not authenticate nodes)"
  need_file "$key" "node private key"
  args+=(--auth-supernode-private-key "$(cd "$(dirname "$key")" && pwd)/$(basename "$key")")
fi

# Refuse to start with missing or mismatched data (the ClientApp would fail on the first message).
check=(check --node-config "$node_config")
[ -n "$config" ] && check+=(--config "$(abspath "$config")")
for s in ${sets[@]+"${sets[@]}"}; do check+=(--set "$s"); done
"$PYTHON" -m promptfcl.client.node_data "${check[@]}" || die "this node's data is not usable for the run (see above)"

mkdir -p "$state"
export FLWR_HOME="$(cd "$state" && pwd)/flwr-home"
# The SuperExec polls this node's local runtime API for new ClientApp tasks (default every 1 s):
# a shorter interval takes up to a second off every message (a local call, cheap).
export FLWR_SUPEREXEC_TASK_POLL_INTERVAL=${FLWR_SUPEREXEC_TASK_POLL_INTERVAL:-0.2}
command -v flower-supernode >/dev/null || die "flower-supernode not found: install promptfcl (make install) first"
echo "SuperNode -> $superlink, node-config: $node_config" >&2
if [ "$warm" = 1 ] && [ "$(uname -s)" != Linux ]; then
  echo "note: the warm executor forks and runs on Linux only; Flower's stock executor on $(uname -s)" >&2
  warm=0
fi
supernode_cmd=("$PYTHON" "$DEPLOY_DIR/supernode.py" --idle-poll "$poll" --rejoin-timeout "$rejoin"
               --heartbeat "$heartbeat")
[ "$warm" = 1 ] || exec "${supernode_cmd[@]}" "${args[@]}"

# Warm: the SuperNode leaves its ClientApp tasks to a SuperExec we start (process isolation);
# a secret shared by the two (0600, in this node's state) keeps other local processes from
# taking those tasks from the SuperNode's Runtime API.
command -v promptfcl-superexec >/dev/null || die "promptfcl-superexec not found: install promptfcl (make install) first"
secret="$FLWR_HOME/superexec.secret"
mkdir -p "$FLWR_HOME"
[ -s "$secret" ] || (umask 077 && "$PYTHON" -c 'import secrets; print(secrets.token_hex(32), end="")' > "$secret")
"${supernode_cmd[@]}" "${args[@]}" --isolation process --superexec-auth-secret-file "$secret" &
supernode=$!
promptfcl-superexec --insecure --runtime-api-address "127.0.0.1:$port" --parent-pid "$supernode" \
  --superexec-auth-secret-file "$secret" &
superexec=$!
trap 'kill "$supernode" "$superexec" 2>/dev/null || true' EXIT
trap 'exit 143' TERM
trap 'exit 130' INT
echo "warm executor: promptfcl-superexec (pid $superexec) beside the SuperNode (pid $supernode)" >&2
status=0
wait "$supernode" || status=$?
exit "$status"
