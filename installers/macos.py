"""Shoal.app and its .dmg, on a Mac.

    python -m installers.macos icns               resources/icons -> build/installer/Shoal.icns
    python -m installers.macos package APP OUT    sign APP, then OUT/Shoal-VERSION-ARCH.dmg

The Info.plist comes from resources/Info.plist (LSUIElement: a menu-bar app with no Dock
icon; NSLocalNetworkUsageDescription and NSBonjourServices so macOS lets Shoal find and
serve its fleet on the LAN). Signing is inside-out, every Mach-O file first and the app last,
with the hardened runtime and installers/macos/entitlements.plist, so a Developer ID build
can be notarised as it is:

    SHOAL_CODESIGN_IDENTITY   "Developer ID Application: NAME (TEAM)"; default "-" (ad hoc)
    SHOAL_NOTARY_PROFILE      a `xcrun notarytool store-credentials` profile: notarise the
                              dmg and staple the ticket (needs a Developer ID identity)

The plist, the dmg layout and the signing commands are plain data, checked on Linux by
tests/installer/test_macos_layout.py; only running the commands needs a Mac.
"""

from __future__ import annotations

import argparse
import os
import platform
import plistlib
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from installers import bundle

INFO_PLIST_TEMPLATE = bundle.ROOT / "resources" / "Info.plist"
ENTITLEMENTS = bundle.ROOT / "installers" / "macos" / "entitlements.plist"
# iconutil's names for each size of an .iconset, and the PNG each one takes
ICONSET = {
    "icon_16x16.png": 16, "icon_16x16@2x.png": 32,
    "icon_32x32.png": 32, "icon_32x32@2x.png": 64,
    "icon_128x128.png": 128, "icon_128x128@2x.png": 256,
    "icon_256x256.png": 256,
}


def icns_path() -> Path:
    return bundle.ROOT / "build" / "installer" / f"{bundle.APP_NAME}.icns"


def info_plist(version: str) -> dict[str, Any]:
    """resources/Info.plist with its version filled in."""
    with INFO_PLIST_TEMPLATE.open("rb") as f:
        data: dict[str, Any] = plistlib.load(f)

    def fill(value: Any) -> Any:
        if isinstance(value, str):
            return value.replace("@VERSION@", version)
        if isinstance(value, list):
            return [fill(v) for v in value]
        if isinstance(value, dict):
            return {k: fill(v) for k, v in value.items()}
        return value

    return {k: fill(v) for k, v in data.items()}


@dataclass(frozen=True)
class DmgEntry:
    """One item of the dmg's window: the app, or a link to where it is dragged."""

    name: str
    kind: str  # "app" or "symlink"
    target: str  # for a symlink: where it points
    position: tuple[int, int]  # icon position in the Finder window (points)


DMG_WINDOW = (640, 400)  # width, height of the Finder window the dmg opens in
DMG_ICON_SIZE = 128


def dmg_layout() -> list[DmgEntry]:
    """What the dmg shows: Shoal.app on the left, an arrow's length from Applications."""
    return [
        DmgEntry(f"{bundle.APP_NAME}.app", "app", "", (160, 190)),
        DmgEntry("Applications", "symlink", "/Applications", (480, 190)),
    ]


def stage_dmg(app: Path, folder: Path) -> Path:
    """Lay out the dmg's content in ``folder`` (works on any POSIX system)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for entry in dmg_layout():
        dest = folder / entry.name
        if entry.kind == "app":
            shutil.copytree(app, dest, symlinks=True)
        else:
            dest.symlink_to(entry.target)
    return folder


def finder_script(volume: str) -> str:
    """AppleScript that sets the dmg window's size, icon size and positions."""
    width, height = DMG_WINDOW
    lines = [
        f'tell application "Finder" to tell disk "{volume}"',
        "open",
        "set current view of container window to icon view",
        "set toolbar visible of container window to false",
        "set statusbar visible of container window to false",
        f"set the bounds of container window to {{100, 100, {100 + width}, {100 + height}}}",
        f"set icon size of the icon view options of container window to {DMG_ICON_SIZE}",
        "set arrangement of the icon view options of container window to not arranged",
    ]
    lines += [f'set position of item "{e.name}" to {{{e.position[0]}, {e.position[1]}}}'
              for e in dmg_layout()]
    lines += ["update without registering applications", "close", "end tell"]
    return "\n".join(lines)


def _macho_files(app: Path) -> list[Path]:
    """Every Mach-O file in the app, deepest first (signing goes inside-out)."""
    magics = {b"\xcf\xfa\xed\xfe", b"\xce\xfa\xed\xfe", b"\xca\xfe\xba\xbe", b"\xbe\xba\xfe\xca"}
    found = []
    for path in app.rglob("*"):
        if path.is_file() and not path.is_symlink():
            with path.open("rb") as f:
                if f.read(4) in magics:
                    found.append(path)
    return sorted(found, key=lambda p: (-len(p.parts), str(p)))


def signing_commands(app: Path, identity: str, files: list[Path]) -> list[list[str]]:
    """codesign calls: each library with the hardened runtime, then the app with the
    entitlements (which cover its main executable)."""
    stamp = "--timestamp=none" if identity == "-" else "--timestamp"
    base = ["codesign", "--force", stamp, "--options", "runtime", "--sign", identity]
    main = app / "Contents" / "MacOS" / bundle.NAME
    cmds = [[*base, str(f)] for f in files if f != main]
    cmds.append([*base, "--entitlements", str(ENTITLEMENTS), str(main)])
    cmds.append([*base, "--entitlements", str(ENTITLEMENTS), str(app)])
    return cmds


def dmg_commands(staged: Path, rw: Path, dmg: Path) -> tuple[list[str], list[str]]:
    """hdiutil calls: a read-write image of the staged folder (styled while mounted), then
    the compressed read-only dmg that is shipped."""
    create = ["hdiutil", "create", "-volname", bundle.APP_NAME, "-srcfolder", str(staged),
              "-fs", "HFS+", "-format", "UDRW", "-ov", str(rw)]
    compress = ["hdiutil", "convert", str(rw), "-format", "UDZO", "-ov", "-o", str(dmg)]
    return create, compress


def _run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def make_icns() -> Path:
    out = icns_path()
    iconset = out.with_suffix(".iconset")
    shutil.rmtree(iconset, ignore_errors=True)
    iconset.mkdir(parents=True)
    icons = bundle.ROOT / bundle.ICONS_DEST
    for name, size in ICONSET.items():
        shutil.copyfile(icons / f"shoal-{size}.png", iconset / name)
    _run(["iconutil", "-c", "icns", "-o", str(out), str(iconset)])
    shutil.rmtree(iconset)
    return out


def package(app: Path, out: Path) -> Path:
    identity = os.environ.get("SHOAL_CODESIGN_IDENTITY", "-")
    profile = os.environ.get("SHOAL_NOTARY_PROFILE")
    if profile and identity == "-":
        raise bundle.BuildError("notarising needs SHOAL_CODESIGN_IDENTITY set to a "
                                "Developer ID Application identity")
    for cmd in signing_commands(app, identity, _macho_files(app)):
        _run(cmd)
    _run(["codesign", "--verify", "--deep", "--strict", "--verbose=2", str(app)])
    staged = stage_dmg(app, out / "dmg")
    dmg = out / f"{bundle.APP_NAME}-{bundle.version()}-{platform.machine()}.dmg"
    rw = out / "dmg-rw.dmg"
    create, compress = dmg_commands(staged, rw, dmg)
    _run(create)
    style_dmg_window(rw)
    _run(compress)
    rw.unlink()
    shutil.rmtree(staged)
    if identity != "-":
        _run(["codesign", "--force", "--timestamp", "--sign", identity, str(dmg)])
    if profile:
        _run(["xcrun", "notarytool", "submit", str(dmg), "--keychain-profile", profile,
              "--wait"])
        _run(["xcrun", "stapler", "staple", str(dmg)])
    return dmg


def style_dmg_window(rw: Path) -> None:
    """Mount the read-write image once to place the icons (best effort: Finder scripting
    needs a logged-in session, which a CI Mac may not have; the dmg works without it)."""
    mount = subprocess.run(["hdiutil", "attach", "-readwrite", "-noverify", "-noautoopen",
                            str(rw)], capture_output=True, text=True, check=True).stdout
    device = mount.split()[0]
    try:
        subprocess.run(["osascript", "-e", finder_script(bundle.APP_NAME)], check=False)
    finally:
        _run(["hdiutil", "detach", device])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m installers.macos", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("icns", help="make build/installer/Shoal.icns from resources/icons")
    pkg = sub.add_parser("package", help="sign Shoal.app and make the .dmg")
    pkg.add_argument("app", type=Path)
    pkg.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if sys.platform != "darwin":
        print("shoal: the macOS installer is built on a Mac (codesign, iconutil, hdiutil)",
              file=sys.stderr)
        return 2
    try:
        if args.cmd == "icns":
            print(make_icns())
        else:
            print(package(args.app, args.out))
    except (bundle.BuildError, subprocess.CalledProcessError) as exc:
        print(f"shoal: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
