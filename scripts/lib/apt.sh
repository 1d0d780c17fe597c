# Sourced by scripts/test and scripts/run: the Debian packages Shoal needs on a fresh machine.
#   cmake, ninja-build, build-essential  build llama.cpp (llama-cpp-python from source, and
#                           llama-server for the tests over the wheel's tree, whose generator
#                           must outlive pip's build: scripts/lib/llama_server.py)
#   iproute2                network namespaces for the multi-host tests
#   dbus, gnome-keyring, libsecret-tools   a real Secret Service for the keychain tests
# The desktop app (Qt's xcb platform plugin; PySide6's wheels bring Qt, not these):
#   libxcb-* libx11-xcb1 libxkbcommon-x11-0 libegl1 libgl1 libfontconfig1 libdbus-1-3
#   libglib2.0-0
# Its tests:
#   xvfb, trayer            an X server and a real tray host for the tray test
#   xdotool, xclip, x11-utils   a real click on the icon, the X clipboard, xwininfo
#   haskell-status-notifier-item-utils, haskell-gtk-sni-tray-utils   a StatusNotifierItem
#                           host for the tray test over D-Bus (status-notifier-watcher,
#                           gtk-sni-tray-standalone)
#   desktop-file-utils      desktop-file-validate checks the autostart entry
#   nginx                   a real reverse proxy in front of a head (tests/integration/
#                           test_admin_trust.py); started by the test only, never as a service
#   tmux, git               the coding agents' tests: Claude Code's interactive start in a
#                           terminal, aider's repository (the npm agents need Node.js 20 and
#                           its npm, which scripts/lib/agents.py asks for by name if missing)
# llama.cpp's Vulkan backend (scripts/lib/vulkan_backend.py) and its tests on Mesa's
# software Vulkan driver (lavapipe), as llama.cpp's own CI runs it:
#   glslc, libvulkan-dev, spirv-headers   the shader compiler, the loader to link, SPIR-V
#                           headers (the Vulkan headers come from Debian 13: see the script)
#   mesa-vulkan-drivers     lavapipe, a Vulkan device on any machine
# The installers (scripts/build-installer) and their tests (tests/installer):
#   dpkg-dev, zstd, binutils    dpkg-shlibdeps, dpkg-deb -Zzstd, the .tar.zst, ar to read a .deb
SHOAL_APT_QT="libxcb-cursor0 libxcb-icccm4 libxcb-image0 libxcb-keysyms1 libxcb-randr0
  libxcb-render-util0 libxcb-shape0 libxcb-xkb1 libxcb-xfixes0 libxcb-sync1 libxcb-shm0
  libx11-xcb1 libxkbcommon-x11-0 libegl1 libgl1 libfontconfig1 libdbus-1-3 libglib2.0-0"
SHOAL_APT_PACKAGES="cmake ninja-build build-essential iproute2 dbus gnome-keyring libsecret-tools
  $SHOAL_APT_QT xvfb trayer xdotool xclip x11-utils haskell-status-notifier-item-utils
  haskell-gtk-sni-tray-utils desktop-file-utils nginx tmux git
  glslc libvulkan-dev spirv-headers mesa-vulkan-drivers dpkg-dev zstd binutils"

# ensure_apt [PACKAGES]  (default: everything the suite needs)
ensure_apt() {
    local missing=() pkg
    for pkg in ${1:-$SHOAL_APT_PACKAGES}; do
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
