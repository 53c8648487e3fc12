# Sourced by scripts/*: make sure .venv exists with hostcall and its extras installed.
# Re-installs only when pyproject.toml changed since the last install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HOSTCALL_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
EXTRAS="${1:-dev}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "scripts: creating $VENV" >&2
    "$PY" -m venv "$VENV"
fi
stamp="$VENV/.hostcall-installed-$EXTRAS"
want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "scripts: installing hostcall[$EXTRAS] into $VENV" >&2
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip >&2
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e "$ROOT[$EXTRAS]" >&2
    echo "$want" > "$stamp"
fi
export PATH="$VENV/bin:$PATH"
