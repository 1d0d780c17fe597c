# Sourced by scripts/test: the Debian packages the suite needs on a fresh machine.
#   cmake, build-essential  build llama.cpp (llama-cpp-python from source)
#   iproute2                network namespaces for the multi-host tests
#   dbus, gnome-keyring, libsecret-tools   a real Secret Service for the keychain tests
SHOAL_APT_PACKAGES="cmake build-essential iproute2 dbus gnome-keyring libsecret-tools"

ensure_apt() {
    local missing=() pkg
    for pkg in $SHOAL_APT_PACKAGES; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" ||
            missing+=("$pkg")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "shoal: no apt-get here; install ${missing[*]} with your package manager (tests that need them skip)" >&2
        return 0
    fi
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    echo "shoal: installing ${missing[*]}"
    $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
}
