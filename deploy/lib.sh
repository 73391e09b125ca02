# Shared helpers for the deploy/ scripts (sourced, not run).

DEPLOY_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_DIR="$(cd "$DEPLOY_DIR/.." && pwd)"
# The project's virtual environment if there is one (make install creates it); else PATH as is.
if [ -z "${PROMPTFCL_NO_VENV:-}" ] && [ -x "$REPO_DIR/.venv/bin/flwr" ]; then
  export PATH="$REPO_DIR/.venv/bin:$PATH"
fi
PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
[ -x "$REPO_DIR/.venv/bin/python" ] && [ -z "${PROMPTFCL_NO_VENV:-}" ] && PYTHON="$REPO_DIR/.venv/bin/python"
export FLWR_TELEMETRY_ENABLED=${FLWR_TELEMETRY_ENABLED:-0}

die() { echo "error: $*" >&2; exit 2; }

abspath() {  # abspath PATH: absolute form of PATH (which need not exist)
  case "$1" in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac
}

need_file() {  # need_file PATH WHAT
  [ -f "$1" ] || die "$2 $1 does not exist"
}

is_loopback() {  # is_loopback HOST: whether HOST is reachable from this machine only
  [[ "$1" =~ ^127\.[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$ || "$1" == localhost || "$1" == ::1 || "$1" == "[::1]" ]]
}

# check_control_address HOST INSECURE(0|1) EXPOSED_FLAG(0|1)
# The Control API (run submission: code every node runs; node registration) has no
# authentication in Flower's open-source SuperLink: TLS encrypts it, but anyone who reaches the
# address may use it. So only loopback, unless the operator says in the flag's own words that
# they know; never without TLS beyond this machine.
check_control_address() {
  local host=$1 insecure=$2 exposed=$3
  is_loopback "$host" && return 0
  [ "$insecure" = 0 ] || die "--insecure with --control-host $host: the Control API (run submission, node registration) must not be served without TLS beyond this machine"
  [ "$exposed" = 1 ] || die "--control-host $host is not loopback: Flower's Control API has no authentication (TLS does not authenticate callers), so anyone who reaches $host could submit runs (code every node runs) and register nodes. Keep it on 127.0.0.1 and reach it over SSH (ssh -L 9093:127.0.0.1:9093 server), or, if a firewall alone guards it, pass --i-know-control-api-is-unauthenticated"
  echo "WARNING: the Control API on $host is UNAUTHENTICATED: whoever reaches it controls the federation; only your network's reachability protects it" >&2
}

# write_connection NAME ADDRESS CA_FILE|"" INSECURE(0|1)
# Adds or replaces [superlink.NAME] in $FLWR_HOME/config.toml (default ~/.flwr), keeping
# the rest of the file; `flwr run . NAME` and `flwr supernode register KEY NAME` then use it.
write_connection() {
  local name=$1 address=$2 ca=$3 insecure=$4
  local home=${FLWR_HOME:-$HOME/.flwr}
  mkdir -p "$home"
  [ -z "$ca" ] || ca="$(cd "$(dirname "$ca")" && pwd)/$(basename "$ca")"
  "$PYTHON" - "$home/config.toml" "$name" "$address" "$ca" "$insecure" <<'EOF'
import re, sys
from pathlib import Path
path, name, address, ca, insecure = Path(sys.argv[1]), *sys.argv[2:]
text = path.read_text() if path.exists() else '[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n'
# drop an existing [superlink.NAME] table (up to the next table header)
text = re.sub(rf"(?ms)^\[superlink\.{re.escape(name)}\]\n.*?(?=^\[|\Z)", "", text).rstrip() + "\n"
block = f'\n[superlink.{name}]\naddress = "{address}"\n'
block += "insecure = true\n" if insecure == "1" else f'root-certificates = "{ca}"\n'
path.write_text(text + block)
EOF
}
