#!/usr/bin/env bash
# Create a certificate authority and a SuperLink server certificate signed by it (TLS).
#
#   deploy/make-certs.sh [--out DIR] [--days N] NAME_OR_IP [NAME_OR_IP ...]
#
# NAME_OR_IP: every address SuperNodes and `flwr` use to reach the SuperLink (a DNS name
# or an IP). 127.0.0.1 and localhost are always added: the SuperLink's own SuperExec
# connects to it locally over TLS.
#
# Writes DIR/ca.crt (give this to every node and to whoever submits runs), DIR/ca.key
# (keep it offline), DIR/server.pem and DIR/server.key (only on the SuperLink machine).
# Refuses to overwrite an existing CA: delete DIR yourself to start over.
set -euo pipefail

out=certs
days=825
names=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --days) days=$2; shift 2 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    -*) echo "error: unknown option $1" >&2; exit 2 ;;
    *) names+=("$1"); shift ;;
  esac
done
if [ ${#names[@]} -eq 0 ]; then
  echo "error: give the SuperLink's address(es), e.g. deploy/make-certs.sh server.example.org 203.0.113.5" >&2
  exit 2
fi
command -v openssl >/dev/null || { echo "error: openssl is required" >&2; exit 1; }
if [ -e "$out/ca.key" ]; then
  echo "error: $out/ca.key exists; refusing to replace the CA (nodes trust it). Remove $out to start over." >&2
  exit 1
fi
mkdir -p "$out"
chmod 700 "$out"

# subjectAltName: DNS names and IP addresses (always 127.0.0.1 and localhost)
san="DNS:localhost,IP:127.0.0.1"
for n in "${names[@]}"; do
  if [[ "$n" =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ || "$n" == *:* ]]; then
    [ "$n" = 127.0.0.1 ] || san="$san,IP:$n"
  else
    [ "$n" = localhost ] || san="$san,DNS:$n"
  fi
done

openssl genrsa -out "$out/ca.key" 4096 2>/dev/null
openssl req -x509 -new -key "$out/ca.key" -sha256 -days "$days" -subj "/CN=promptfcl CA" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
  -out "$out/ca.crt"
openssl genrsa -out "$out/server.key" 4096 2>/dev/null
openssl req -new -key "$out/server.key" -subj "/CN=${names[0]}" -out "$out/server.csr"
ext=$(mktemp)
trap 'rm -f "$ext"' EXIT
cat >"$ext" <<EOF
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=$san
EOF
openssl x509 -req -in "$out/server.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" -CAcreateserial \
  -days "$days" -sha256 -extfile "$ext" -out "$out/server.pem" 2>/dev/null
rm -f "$out/server.csr" "$out/ca.srl"
chmod 600 "$out/ca.key" "$out/server.key"
openssl verify -CAfile "$out/ca.crt" "$out/server.pem" >/dev/null
echo "CA:          $out/ca.crt   (copy to every node and to the machine that submits runs)"
echo "CA key:      $out/ca.key   (keep offline)"
echo "server cert: $out/server.pem, key $out/server.key   (SuperLink machine only)"
echo "valid for:   $san"
