# Sourced by scripts/test and scripts/run: create or reuse .venv/ at the repository root and install
# the project with the extras named in LOOM_EXTRAS, pinned by constraints.txt. Reinstalls only when
# pyproject.toml, constraints.txt or the extras change.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
stamp="$venv/.loom-install-stamp"
want="$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1) ${LOOM_EXTRAS}"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    "$venv/bin/python" -m pip install --quiet -c constraints.txt -e ".[${LOOM_EXTRAS}]"
    echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
