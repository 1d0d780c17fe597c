# Sourced by scripts/run and scripts/test: make .venv and install Shoal into it.
# Idempotent: a stamp of pyproject.toml and the extras skips pip on later calls.

shoal_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

shoal_python() {
    for py in python3.13 python3.12 python3.11 python3; do
        if command -v "$py" >/dev/null 2>&1 &&
            "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            echo "$py"
            return 0
        fi
    done
    echo "shoal: Python 3.11 or newer is needed; install it (apt install python3) and run again" >&2
    return 1
}

# ensure_venv EXTRAS  e.g. ensure_venv "llamacpp,hub" or "llamacpp,hub,dev"
ensure_venv() {
    local extras="$1" venv="$shoal_root/.venv" py stamp want
    if [ ! -x "$venv/bin/python" ]; then
        py="$(shoal_python)" || return 1
        echo "shoal: creating $venv"
        "$py" -m venv "$venv" || {
            echo "shoal: cannot create a virtual environment; install python3-venv and run again" >&2
            return 1
        }
    fi
    stamp="$venv/.shoal-installed"
    want="$extras $(sha256sum "$shoal_root/pyproject.toml" | cut -c1-16)"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        return 0
    fi
    echo "shoal: installing Shoal and its dependencies into .venv (the first time builds llama.cpp: about 15 minutes on 2 cores)"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    # the multimodal part of llama.cpp is not used; skipping it saves build time
    CMAKE_ARGS="${CMAKE_ARGS:--DLLAVA_BUILD=OFF}" \
        "$venv/bin/python" -m pip install --progress-bar off -e "$shoal_root[$extras]" || {
        echo "shoal: installing the Python packages failed (see above); check the network and a C compiler (apt install build-essential cmake)" >&2
        return 1
    }
    echo "$want" >"$stamp"
}
