# Sourced by scripts/run and scripts/test: make .venv and install Shoal into it.
# Idempotent: a stamp of pyproject.toml, the extras and the llama.cpp wheel skips pip on
# later calls. llama.cpp is the portable wheel of scripts/lib/llama_wheel.sh, built once per
# machine: the same build the installer's tests bundle, so it is compiled once, not twice.

shoal_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
. "$shoal_root/scripts/lib/llama_wheel.sh"

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
    local wheel=""
    case ",$extras," in
        *,llamacpp,*) wheel="$(ensure_llama_wheel "$venv/bin/python")" || return 1 ;;
    esac
    want="$extras $(sha256sum "$shoal_root/pyproject.toml" | cut -c1-16) $wheel"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        return 0
    fi
    echo "shoal: installing Shoal and its dependencies into .venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    if [ -n "$wheel" ]; then
        # the wheel named as a file wins over any llama-cpp-python pip could find or build
        "$venv/bin/python" -m pip install --quiet --progress-bar off --no-deps \
            --force-reinstall "$wheel" || return 1
    fi
    "$venv/bin/python" -m pip install --progress-bar off -e "$shoal_root[$extras]" || {
        echo "shoal: installing the Python packages failed (see above); check the network and a C compiler (apt install build-essential cmake)" >&2
        return 1
    }
    echo "$want" >"$stamp"
}
