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
