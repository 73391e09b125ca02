#!/usr/bin/env bash
# Create a SuperNode authentication key pair (ECDSA P-384, OpenSSH format, no passphrase).
#
#   deploy/make-node-key.sh [--out DIR] NODE_NAME
#
# Run it on the node: DIR/NODE_NAME stays there (--auth-supernode-private-key);
# send DIR/NODE_NAME.pub to the federation's operator, who registers it with
#   deploy/register-node.sh DIR/NODE_NAME.pub
# A SuperLink started with --enable-supernode-auth refuses every node whose key is not registered.
set -euo pipefail

out=keys
name=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
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
echo "public key:  $out/$name.pub  (register it: deploy/register-node.sh $out/$name.pub)"
