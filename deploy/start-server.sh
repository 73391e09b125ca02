#!/usr/bin/env bash
# Start the SuperLink (the server side) in the foreground, with TLS and node authentication.
#
#   deploy/start-server.sh --certs certs [--state DIR] [--host 0.0.0.0] [--port 8000]
#                          [--no-node-auth] [--insecure]
#
#   --certs DIR      holds ca.crt, server.pem, server.key (deploy/make-certs.sh)
#   --state DIR      persistent state: DIR/state.db (runs, registered nodes), DIR/flwr-home
#                    (installed app bundles); the ServerApp runs in DIR, so a relative
#                    out-dir lands in DIR/<out-dir>. Default: ./superlink-state
#   --host, --port   where the SuperLink listens; one HTTPS port serves the Fleet API
#                    (SuperNodes), the Control API (`flwr run`, node registration) and the
#                    ServerApp runtime. Default 0.0.0.0:8000.
#   --no-node-auth   accept any SuperNode (default: only registered keys, deploy/register-node.sh)
#   --insecure       no TLS at all: only for a closed test network, never across the internet
#
# Runtime dependency installation is off: the SuperLink machine must have promptfcl
# installed (make install, or the container image) - nothing is fetched per run.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

certs=""; state=superlink-state; host=0.0.0.0; port=8000; auth=1; insecure=0
while [ $# -gt 0 ]; do
  case "$1" in
    --certs) certs=$2; shift 2 ;;
    --state) state=$2; shift 2 ;;
    --host) host=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --no-node-auth) auth=0; shift ;;
    --insecure) insecure=1; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done

args=(--host "$host" --port "$port" --disable-runtime-dependency-installation)
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

mkdir -p "$state"
state="$(cd "$state" && pwd)"
args+=(--database "$state/state.db")
export FLWR_HOME="$state/flwr-home"
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
command -v flower-superlink >/dev/null || die "flower-superlink not found: install promptfcl (make install) first"
"$PYTHON" -c "import server.app, client.app" 2>/dev/null \
  || die "promptfcl is not importable by $PYTHON: install it on this machine first (make install)"
cd "$state"
echo "SuperLink on $host:$port, state in $state, node authentication $([ $auth = 1 ] && echo on || echo off)" >&2
# flower-superlink with a longer HTTP keep-alive (deploy/superlink.py says why).
exec "$PYTHON" "$DEPLOY_DIR/superlink.py" "${args[@]}"
