#!/usr/bin/env bash
# Register a SuperNode's public key with a SuperLink that runs with node authentication.
#
#   deploy/register-node.sh --superlink HOST:PORT --ca certs/ca.crt [--name NAME] KEY.pub
#   deploy/register-node.sh --superlink HOST:PORT --insecure KEY.pub      (TLS off: test setups only)
#
# Uses (and updates) the `flwr` connection "promptfcl" in $FLWR_HOME/config.toml
# (default ~/.flwr). Prints the node id the SuperLink assigned to the key.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

superlink=""; ca=""; insecure=0; name=""; key=""
while [ $# -gt 0 ]; do
  case "$1" in
    --superlink) superlink=$2; shift 2 ;;
    --ca) ca=$2; shift 2 ;;
    --insecure) insecure=1; shift ;;
    --name) name=$2; shift 2 ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    -*) die "unknown option $1" ;;
    *) key=$1; shift ;;
  esac
done
[ -n "$superlink" ] || die "--superlink HOST:PORT is required"
[ -n "$key" ] || die "give the node's public key file (KEY.pub)"
need_file "$key" "public key"
if [ "$insecure" = 0 ]; then
  [ -n "$ca" ] || die "--ca certs/ca.crt is required (or --insecure for a test setup without TLS)"
  need_file "$ca" "CA certificate"
fi
write_connection promptfcl "$superlink" "$ca" "$insecure"
args=()
[ -n "$name" ] && args+=(--name "$name")
flwr supernode register "$key" promptfcl ${args[@]+"${args[@]}"}
