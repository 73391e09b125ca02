#!/usr/bin/env bash
# Create a SuperNode authentication key pair (ECDSA P-384, OpenSSH format, no passphrase).
#
#   deploy/make-node-key.sh [--out DIR] [--control HOST:PORT] [--ca FILE] NODE_NAME
#
# Run it on the node: DIR/NODE_NAME stays there (--auth-supernode-private-key);
# send DIR/NODE_NAME.pub to the federation's operator, who registers it on the server machine
# with the command this prints:
#   deploy/register-node.sh --superlink HOST:PORT --ca FILE --name NODE_NAME DIR/NODE_NAME.pub
#   --control HOST:PORT  the SuperLink's control address in that command, as the server machine
#                        reaches it (default 127.0.0.1:9093, deploy/start-server.sh's)
#   --ca FILE            the CA certificate there (default certs/ca.crt, deploy/make-certs.sh's)
# A SuperLink started with --enable-supernode-auth refuses every node whose key is not registered.
set -euo pipefail

out=keys
name=""
control=127.0.0.1:9093
ca=certs/ca.crt
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --control) control=$2; shift 2 ;;
    --ca) ca=$2; shift 2 ;;
    -h|--help) sed -n "2,$(( $(grep -n '^set -euo' "$0" | cut -d: -f1) - 1 ))p" "$0"; exit 0 ;;
    -*) echo "error: unknown option $1" >&2; exit 2 ;;
    *) name=$1; shift ;;
  esac
done
[ -n "$name" ] || { echo "error: give the node's name, e.g. deploy/make-node-key.sh node1" >&2; exit 2; }
mkdir -p "$out"
chmod 700 "$out"
if [ -e "$out/$name" ]; then
  echo "error: $out/$name exists; refusing to overwrite a node key" >&2
  exit 1
fi
if command -v ssh-keygen >/dev/null; then
  ssh-keygen -q -t ecdsa -b 384 -N "" -C "promptfcl-$name" -f "$out/$name"
else  # the `cryptography` package ships with flwr
  PY=${PYTHON:-python3}
  "$PY" - "$out/$name" <<'EOF'
import sys
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

key = ec.generate_private_key(ec.SECP384R1())
path = sys.argv[1]
with open(path, "wb") as fh:
    fh.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                               serialization.NoEncryption()))
with open(path + ".pub", "wb") as fh:
    fh.write(key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
             + b"\n")
EOF
fi
chmod 600 "$out/$name"
echo "private key: $out/$name      (stays on the node)"
echo "public key:  $out/$name.pub  (send it to the federation's operator)"
# register-node.sh's own arguments, each quoted for the shell: the line works as typed on the server
# machine, from the folder holding the CA certificate and the .pub file
echo "register it on the server machine (where deploy/start-server.sh runs), with the .pub file at $out/$name.pub:"
command=$(printf '%q ' "$(dirname "$0")/register-node.sh" --superlink "$control" --ca "$ca" --name "$name" \
  "$out/$name.pub")
echo "  ${command% }"
