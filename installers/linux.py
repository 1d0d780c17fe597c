"""The Linux packages of a built bundle: a .deb for Debian and Ubuntu, and a .tar.zst with an
install script for every other distribution.

    python -m installers.linux BUNDLE_DIR OUT_DIR

The .deb puts the bundle under /opt/shoal, the program at /usr/bin/shoal (the app and the
CLI are one program), the desktop entry and the hicolor icons under /usr/share. Its
dependencies are what the bundle's libraries link against (dpkg-shlibdeps) plus what Qt
opens at run time by name; the Vulkan loader and Mesa's drivers are only recommended (a node
loads llama.cpp's Vulkan backend when it can, and runs on the CPU where it cannot).
Removing it leaves nothing behind but each user's $SHOAL_HOME (models, token, settings): a
package never touches home folders.
"""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

from installers import bundle

PREFIX = "/opt/shoal"
MAINTAINER = "Shoal developers <dev@shoal.invalid>"
SUMMARY = "Pool your machines into one private LLM endpoint"
DESCRIPTION = """\
 Shoal turns the Macs and Linux desktops on a desk, a LAN or a tailnet into one
 OpenAI- and Ollama-compatible endpoint on http://127.0.0.1:8453/v1. Every
 machine serves a model; conversations are placed on the least loaded one. It
 comes with a small default model, so it answers with no network at all.
 .
 This package holds the tray app (shoal app, or Shoal in the applications menu)
 and the same program as a command line for headless machines (shoal serve,
 shoal node join, ...)."""

# Opened by name at run time (dlopen), so no ELF file of the bundle names them: Qt's D-Bus
# (the StatusNotifierItem tray icon, notifications), its GL/EGL and xcb/Wayland platform
# libraries, and at least one font.
RUNTIME_DEPENDS = [
    "libdbus-1-3",
    "libegl1",
    "libgl1",
    "libxkbcommon0",
    "libxkbcommon-x11-0",
    "libxcb-cursor0",
    "libxcb-icccm4",
    "libxcb-keysyms1",
    "libxcb-shape0",
    "libwayland-client0",
    "libwayland-cursor0",
    "libwayland-egl1",
    "libfontconfig1",
    "fonts-dejavu-core | fonts-liberation2 | fonts-noto-core",
]


# What the GPU backend (bundle.GPU_LIBS) needs: recommended, never depended on. The backend
# is loaded by the node at run time and is optional, so it is left out of dpkg-shlibdeps'
# scan, which would make its libvulkan1 a hard dependency.
RECOMMENDS = ["libvulkan1", "mesa-vulkan-drivers"]
# the .tar.zst's zstd level: a release packs at 10 (8 % smaller than 1, about 9 s of CPU for
# the 275 MB bundle against 1.3 s); the installer's tests, which unpack it once, ask for 1
TAR_ZSTD_LEVEL = "SHOAL_TAR_ZSTD_LEVEL"


class PackageError(Exception):
    """One line: what went wrong and how to fix it."""


def deb_arch() -> str:
    try:
        out = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True,
                             check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine)


def tar_arch() -> str:
    return os.uname().machine


def _run(cmd: list[str], *, cwd: Path | None = None) -> str:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise PackageError(
            f"{cmd[0]} is not installed; install dpkg-dev, desktop-file-utils and zstd "
            "(apt install dpkg-dev desktop-file-utils zstd)"
        ) from None
    if out.returncode != 0:
        lines = (out.stderr or out.stdout).strip().splitlines()
        # the tool's errors, not the warnings that come before them
        tail = [ln for ln in lines if "error" in ln.lower()][:3] or lines[-5:]
        raise PackageError(f"{cmd[0]} failed: {' | '.join(tail)}")
    return out.stdout


def _elf_files(root: Path) -> list[Path]:
    found = []
    for path in sorted(root.rglob("*")):
        if path.is_symlink() or not path.is_file():
            continue
        with path.open("rb") as f:
            if f.read(4) == b"\x7fELF":
                found.append(path)
    return found


def scanned_files(bundle_dir: Path) -> list[Path]:
    """The ELF files whose libraries the package depends on: all but the GPU backend."""
    return [p for p in _elf_files(bundle_dir) if p.name not in bundle.GPU_LIBS]


def shlib_depends(bundle_dir: Path) -> list[str]:
    """The packages providing the system libraries the bundle's ELF files link against."""
    elves = scanned_files(bundle_dir)
    private = sorted({str(p.parent) for p in elves if ".so" in p.name})
    work = bundle_dir.parent / "shlibdeps"
    shutil.rmtree(work, ignore_errors=True)
    (work / "debian").mkdir(parents=True)
    (work / "debian" / "control").write_text(
        "Source: shoal\n\nPackage: shoal\nArchitecture: any\n"
    )
    cmd = ["dpkg-shlibdeps", "-O", "--ignore-missing-info", "-xshoal"]
    cmd += [f"-l{d}" for d in private]
    cmd += [str(p) for p in elves]
    out = _run(cmd, cwd=work)
    shutil.rmtree(work, ignore_errors=True)
    for line in out.splitlines():
        if line.startswith("shlibs:Depends="):
            return [d.strip() for d in line.split("=", 1)[1].split(",") if d.strip()]
    return []


def depends_field(linked: list[str]) -> str:
    """Depends: what the bundle links against and what Qt opens, without the recommended."""
    optional = set(RECOMMENDS)
    linked = [d for d in linked if d.split()[0] not in optional]
    names = {d.split()[0] for d in linked}
    extra = [d for d in RUNTIME_DEPENDS if d.split()[0] not in names]
    return ", ".join(linked + extra)


def depends(bundle_dir: Path) -> str:
    return depends_field(shlib_depends(bundle_dir))


def control_text(version: str, arch: str, installed_kib: int, depends: str) -> str:
    """The package's DEBIAN/control."""
    return (
        f"Package: shoal\nVersion: {version}\nArchitecture: {arch}\n"
        f"Maintainer: {MAINTAINER}\nInstalled-Size: {installed_kib}\n"
        f"Depends: {depends}\nRecommends: {', '.join(RECOMMENDS)}\n"
        "Section: net\nPriority: optional\n"
        f"Description: {SUMMARY}\n{DESCRIPTION}\n"
    )


def desktop_text(exec_path: str) -> str:
    """The desktop entry with Exec and TryExec pointing at ``exec_path``."""
    lines = []
    for line in bundle.desktop_entry().read_text().splitlines():
        if line.startswith("Exec="):
            rest = line[len("Exec="):].split(None, 1)
            line = "Exec=" + " ".join([exec_path, *rest[1:]])
        elif line.startswith("TryExec="):
            line = f"TryExec={exec_path}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def _install_icons(share: Path) -> None:
    for size in bundle.ICON_SIZES:
        dest = share / "icons" / "hicolor" / f"{size}x{size}" / "apps" / "shoal.png"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(bundle.ROOT / bundle.ICONS_DEST / f"shoal-{size}.png", dest)
    svg = share / "icons" / "hicolor" / "scalable" / "apps" / "shoal.svg"
    svg.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(bundle.ROOT / bundle.ICONS_DEST / "shoal.svg", svg)


def _tree_size_kib(root: Path) -> int:
    total = 0
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    return (total + 1023) // 1024


def build_deb(bundle_dir: Path, out_dir: Path, version: str) -> Path:
    """``shoal_VERSION_ARCH.deb`` in ``out_dir``, built from the onedir bundle."""
    arch = deb_arch()
    stage = out_dir / f"deb-{arch}"
    shutil.rmtree(stage, ignore_errors=True)
    opt = stage / PREFIX.lstrip("/")
    shutil.copytree(bundle_dir, opt, symlinks=True)
    # only root may write what root runs: no group or world write bits anywhere
    for path in [opt, *opt.rglob("*")]:
        if not path.is_symlink():
            path.chmod(path.stat().st_mode & ~(stat.S_IWGRP | stat.S_IWOTH))
    usr_bin = stage / "usr" / "bin"
    usr_bin.mkdir(parents=True)
    (usr_bin / "shoal").symlink_to(f"{PREFIX}/shoal")
    share = stage / "usr" / "share"
    apps = share / "applications"
    apps.mkdir(parents=True)
    (apps / "shoal.desktop").write_text(desktop_text("/usr/bin/shoal"))
    _run(["desktop-file-validate", str(apps / "shoal.desktop")])
    _install_icons(share)
    doc = share / "doc" / "shoal"
    doc.mkdir(parents=True)
    (doc / "copyright").write_text(
        "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n"
        "Upstream-Name: shoal\n\nFiles: *\nCopyright: Shoal developers\nLicense: Apache-2.0\n"
        " On Debian systems the full text is in /usr/share/common-licenses/Apache-2.0.\n"
    )
    control = stage / "DEBIAN" / "control"
    control.parent.mkdir()
    control.write_text(control_text(version, arch, _tree_size_kib(stage), depends(opt)))
    deb = out_dir / f"shoal_{version}_{arch}.deb"
    deb.unlink(missing_ok=True)
    _run(["dpkg-deb", "--root-owner-group", "-Zzstd", "--build", str(stage), str(deb)])
    shutil.rmtree(stage, ignore_errors=True)
    return deb


INSTALL_SH = r"""#!/bin/sh
# Install Shoal from this folder, on any Linux distribution.
#   ./install.sh              for you alone: ~/.local/opt/shoal, ~/.local/bin/shoal
#   sudo ./install.sh --system   for everyone: /opt/shoal, /usr/local/bin/shoal
#   ./install.sh --uninstall  (with --system for the system-wide one) removes it again;
#                             your models, token and settings in ~/.shoal stay.
set -eu
here="$(cd "$(dirname "$0")" && pwd)"
mode=user action=install
for arg in "$@"; do
    case "$arg" in
        --system) mode=system ;;
        --uninstall) action=uninstall ;;
        -h|--help) sed -n '2,6p' "$0"; exit 0 ;;
        *) echo "install.sh: unknown option $arg (try --help)" >&2; exit 2 ;;
    esac
done
if [ "$mode" = system ]; then
    opt=/opt/shoal bin=/usr/local/bin share=/usr/local/share
else
    opt="$HOME/.local/opt/shoal" bin="$HOME/.local/bin" share="${XDG_DATA_HOME:-$HOME/.local/share}"
fi
# (no update-desktop-database: the entry declares no MIME types, and the menus watch the
# applications folder themselves; its mimeinfo.cache would be left in a user's home)
refresh() {
    command -v gtk-update-icon-cache >/dev/null 2>&1 &&
        gtk-update-icon-cache -q -t "$share/icons/hicolor" 2>/dev/null || true
}
if [ "$action" = uninstall ]; then
    rm -rf "$opt"
    rm -f "$bin/shoal" "$share/applications/shoal.desktop"
    rm -f "$share"/icons/hicolor/*/apps/shoal.png "$share"/icons/hicolor/scalable/apps/shoal.svg
    if [ -n "$(find "$share/icons/hicolor" -type f ! -name icon-theme.cache 2>/dev/null |
               head -n 1)" ]; then
        refresh  # other programs' icons are there: their cache, without ours
    else
        rm -f "$share/icons/hicolor/icon-theme.cache"  # ours alone: leave no cache behind
    fi
    echo "Shoal is removed. Your models, token and settings stay in ${SHOAL_HOME:-$HOME/.shoal}."
    exit 0
fi
rm -rf "$opt.new"
mkdir -p "$(dirname "$opt")" "$bin" "$share/applications"
cp -a "$here/shoal" "$opt.new"
rm -rf "$opt"
mv "$opt.new" "$opt"
ln -sf "$opt/shoal" "$bin/shoal"
sed -e "s|@SHOAL@|$opt/shoal|g" "$here/shoal.desktop.in" >"$share/applications/shoal.desktop"
(cd "$here/icons" && find . -type f) | while read -r icon; do
    mkdir -p "$share/icons/hicolor/$(dirname "$icon")"
    cp "$here/icons/$icon" "$share/icons/hicolor/$icon"
done
refresh
echo "Shoal is installed: start it from the applications menu, or run: $bin/shoal app"
case ":$PATH:" in *":$bin:"*) ;; *) echo "(add $bin to your PATH to type just 'shoal')" ;; esac
"""


def build_tar(bundle_dir: Path, out_dir: Path, version: str) -> Path:
    """``shoal-VERSION-linux-ARCH.tar.zst``: the bundle, its desktop entry, icons and
    install.sh, in one folder."""
    name = f"shoal-{version}-linux-{tar_arch()}"
    stage = out_dir / name
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    shutil.copytree(bundle_dir, stage / "shoal", symlinks=True)
    (stage / "shoal.desktop.in").write_text(desktop_text("@SHOAL@"))
    share = stage / "share"
    _install_icons(share)
    shutil.move(str(share / "icons" / "hicolor"), str(stage / "icons"))
    shutil.rmtree(share)
    script = stage / "install.sh"
    script.write_text(INSTALL_SH)
    script.chmod(0o755)
    (stage / "README").write_text(textwrap.dedent(f"""\
        Shoal {version} for Linux ({tar_arch()})

        ./install.sh               install for you alone (no root needed)
        sudo ./install.sh --system install for every user of this machine
        ./install.sh --uninstall   remove it again (your ~/.shoal stays)

        Or run it from here without installing: ./shoal/shoal app
        More: docs/install.md in the Shoal repository.
        """))
    tar = out_dir / f"{name}.tar.zst"
    tar.unlink(missing_ok=True)
    level = int(os.environ.get(TAR_ZSTD_LEVEL) or 10)
    _run(["tar", "--owner=0", "--group=0", "--numeric-owner", "-I", f"zstd -T0 -{level}",
          "-cf", str(tar), "-C", str(out_dir), name])
    shutil.rmtree(stage, ignore_errors=True)
    return tar


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m installers.linux", description=__doc__)
    parser.add_argument("bundle", type=Path, help="the onedir bundle (dist/shoal)")
    parser.add_argument("out", type=Path, help="where the .deb and .tar.zst go")
    parser.add_argument("--no-tar", action="store_true", help="build only the .deb")
    args = parser.parse_args(argv)
    if not (args.bundle / "shoal").is_file():
        print(f"shoal: {args.bundle} holds no built bundle; run scripts/build-installer",
              file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        version = bundle.version()
        print(build_deb(args.bundle, args.out, version))
        if not args.no_tar:
            print(build_tar(args.bundle, args.out, version))
    except (PackageError, bundle.BuildError) as exc:
        print(f"shoal: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
