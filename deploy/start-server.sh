#!/usr/bin/env bash
# Start the SuperLink (the server side) in the foreground, with TLS and node authentication.
#
#   deploy/start-server.sh --certs certs [--state DIR] [--host 0.0.0.0] [--port 8000]
#                          [--control-host 127.0.0.1] [--control-port 9093]
#                          [--i-know-control-api-is-unauthenticated]
#                          [--no-node-auth] [--insecure] [--dry-run]
#
#   --certs DIR      holds ca.crt, server.pem, server.key (deploy/make-certs.sh)
#   --state DIR      persistent state: DIR/state.db (runs, registered nodes), DIR/flwr-home
#                    (installed app bundles); the ServerApp runs in DIR, so a relative
#                    out-dir lands in DIR/<out-dir>. Default: ./superlink-state. Made private
#                    (0700) and everything the SuperLink writes is created under umask 077.
#   --host, --port   the node-facing address: serves only the Fleet API (/v1/fleet/*, what
#                    SuperNodes call) and /health; anything else is refused (403, logged).
#                    Default 0.0.0.0:8000.
#   --control-host, --control-port
#                    the operator's address: the Control API (`flwr run`, `flwr supernode
#                    register`, logs, stopping runs) and the ServerApp runtime. Default
#                    127.0.0.1:9093 (this machine only). The Control API has NO authentication
#                    in Flower's open-source SuperLink (TLS encrypts, it does not authenticate
#                    callers): reach it over SSH (ssh -L 9093:127.0.0.1:9093 server). A
#                    non-loopback control host is refused unless you also pass
#                    --i-know-control-api-is-unauthenticated (and never with --insecure).
#                    deploy/submit-run.sh and deploy/register-node.sh use this address.
#   --max-object-bytes N
#                    the largest object a node may push (default 256000000, the run config's
#                    max-reply-bytes default); every other node call is bounded to 256 KiB, and
#                    a call without a node's signed headers is refused before its body is read
#   --no-node-auth   accept any SuperNode (default: only registered keys, deploy/register-node.sh)
#   --insecure       no TLS at all: only for a closed test network, never across the internet
#   --dry-run        check the arguments and files, create the state folder, print the
#                    SuperLink's command, and start nothing
#
# Runtime dependency installation is off: the SuperLink machine must have promptfcl
# installed (make install, or the container image) - nothing is fetched per run.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

certs=""; state=superlink-state; host=0.0.0.0; port=8000; auth=1; insecure=0
control_host=127.0.0.1; control_port=9093; exposed=0; dry_run=0; max_object=256000000
while [ $# -gt 0 ]; do
  case "$1" in
    --certs) certs=$2; shift 2 ;;
    --state) state=$2; shift 2 ;;
    --host) host=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --control-host) control_host=$2; shift 2 ;;
    --control-port) control_port=$2; shift 2 ;;
    --max-object-bytes) max_object=$2; shift 2 ;;
    --no-node-auth) auth=0; shift ;;
    --insecure) insecure=1; shift ;;
    --i-know-control-api-is-unauthenticated) exposed=1; shift ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) sed -n "2,$(( $(grep -n '^set -euo' "$0" | cut -d: -f1) - 1 ))p" "$0"; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done

[[ "$port" =~ ^[0-9]+$ && "$control_port" =~ ^[0-9]+$ ]] || die "--port and --control-port must be numbers"
[[ "$max_object" =~ ^[1-9][0-9]*$ ]] || die "--max-object-bytes must be a positive number of bytes"
[ "$port" != "$control_port" ] \
  || die "the node-facing address ($host:$port) and the control address ($control_host:$control_port) must differ"
check_control_address "$control_host" "$insecure" "$exposed"
# Flower's --host/--port: the control listener (Flower's own lifespan and SuperExec use it);
# deploy/superlink.py adds the node-facing listener.
args=(--fleet-host "$host" --fleet-port "$port" --max-object-bytes "$max_object" --host "$control_host"
      --port "$control_port" --disable-runtime-dependency-installation)
if [ "$insecure" = 1 ]; then
  [ -z "$certs" ] || die "--insecure and --certs contradict each other"
  echo "WARNING: starting the SuperLink WITHOUT TLS (--insecure): traffic is readable and forgeable" >&2
  args+=(--insecure)
else
  [ -n "$certs" ] || die "--certs DIR is required (deploy/make-certs.sh creates it); --insecure only for test networks"
  for f in ca.crt server.pem server.key; do need_file "$certs/$f" "TLS file"; done
  certs="$(cd "$certs" && pwd)"
  args+=(--ssl-ca-certfile "$certs/ca.crt" --ssl-certfile "$certs/server.pem" --ssl-keyfile "$certs/server.key")
fi
[ "$auth" = 1 ] && args+=(--enable-supernode-auth)

# state.db (registered node keys, runs), app bundles and results: the operator's alone (the
# ServerApp, a child of the SuperLink, keeps this umask: its results are 0600 here too)
umask 077
mkdir -p "$state"
chmod 700 "$state"
state="$(cd "$state" && pwd)"
args+=(--database "$state/state.db")
export FLWR_HOME="$state/flwr-home"
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
if [ "$dry_run" = 1 ]; then
  echo "dry run: would start $PYTHON $DEPLOY_DIR/superlink.py ${args[*]} (in $state)"
  exit 0
fi
command -v flower-superlink >/dev/null || die "flower-superlink not found: install promptfcl (make install) first"
"$PYTHON" -c "import promptfcl.server.app, promptfcl.client.app" 2>/dev/null \
  || die "promptfcl is not importable by $PYTHON: install it on this machine first (make install)"
cd "$state"
echo "SuperLink: nodes on $host:$port (Fleet API only), operator on $control_host:$control_port, state in $state, node authentication $([ $auth = 1 ] && echo on || echo off)" >&2
# flower-superlink on two listeners, with a longer HTTP keep-alive (deploy/superlink.py says why).
exec "$PYTHON" "$DEPLOY_DIR/superlink.py" "${args[@]}"
