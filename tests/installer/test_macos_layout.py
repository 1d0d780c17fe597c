"""The macOS installer, checked on any machine: the Info.plist Shoal.app gets, the dmg's
layout, and the signing commands (running them needs a Mac; what they are does not)."""

from __future__ import annotations

import plistlib
from pathlib import Path

from installers import bundle, macos


def test_info_plist_makes_a_menu_bar_app_allowed_on_the_local_network() -> None:
    plist = macos.info_plist("1.2.3")
    # a menu-bar (tray) app: no Dock icon, no menu bar of its own
    assert plist["LSUIElement"] is True
    # macOS asks the user before local-network traffic, showing this line
    assert "network" in plist["NSLocalNetworkUsageDescription"]
    # mDNS discovery of the fleet is allowed only for the services listed here
    assert plist["NSBonjourServices"] == ["_shoal-fleet._tcp"]
    assert plist["CFBundleIdentifier"] == bundle.BUNDLE_ID
    assert plist["CFBundleExecutable"] == bundle.NAME
    assert plist["CFBundleShortVersionString"] == plist["CFBundleVersion"] == "1.2.3"
    assert "@VERSION@" not in plistlib.dumps(plist).decode()


def test_the_bonjour_service_is_the_one_the_engine_announces() -> None:
    from engine.discovery.mdns import SERVICE_TYPE

    assert macos.info_plist("0")["NSBonjourServices"] == [SERVICE_TYPE.removesuffix(".local.")]


def test_the_plist_is_written_as_macos_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "Info.plist"
    path.write_bytes(plistlib.dumps(macos.info_plist(bundle.version()), fmt=plistlib.FMT_XML))
    back = plistlib.loads(path.read_bytes())
    assert back["CFBundleVersion"] == bundle.version()
    assert back["LSUIElement"] is True


def test_entitlements_allow_ctypes_and_our_own_libraries_and_nothing_else() -> None:
    ent = plistlib.loads(macos.ENTITLEMENTS.read_bytes())
    assert ent == {
        "com.apple.security.cs.allow-unsigned-executable-memory": True,
        "com.apple.security.cs.disable-library-validation": True,
    }


def test_the_dmg_holds_the_app_and_a_link_to_applications(tmp_path: Path) -> None:
    layout = macos.dmg_layout()
    assert [(e.name, e.kind, e.target) for e in layout] == [
        ("Shoal.app", "app", ""),
        ("Applications", "symlink", "/Applications"),
    ]
    # side by side in the window, the app on the left, both inside it
    (app, link) = layout
    width, height = macos.DMG_WINDOW
    assert app.position[0] < link.position[0] and app.position[1] == link.position[1]
    assert all(0 < e.position[0] < width and 0 < e.position[1] < height for e in layout)

    fake_app = tmp_path / "build" / "Shoal.app"
    (fake_app / "Contents" / "MacOS").mkdir(parents=True)
    (fake_app / "Contents" / "MacOS" / "shoal").write_bytes(b"\xcf\xfa\xed\xfe")
    staged = macos.stage_dmg(fake_app, tmp_path / "dmg")
    assert sorted(p.name for p in staged.iterdir()) == ["Applications", "Shoal.app"]
    assert (staged / "Applications").is_symlink()
    assert str((staged / "Applications").readlink()) == "/Applications"
    assert (staged / "Shoal.app" / "Contents" / "MacOS" / "shoal").is_file()
    script = macos.finder_script("Shoal")
    assert 'set position of item "Shoal.app" to {160, 190}' in script
    assert 'set position of item "Applications" to {480, 190}' in script

    create, compress = macos.dmg_commands(staged, tmp_path / "rw.dmg", tmp_path / "S.dmg")
    assert create[:2] == ["hdiutil", "create"] and str(staged) in create
    assert compress[-1] == str(tmp_path / "S.dmg") and "UDZO" in compress


def test_signing_goes_inside_out_with_the_hardened_runtime(tmp_path: Path) -> None:
    app = tmp_path / "Shoal.app"
    main = app / "Contents" / "MacOS" / "shoal"
    lib = app / "Contents" / "Frameworks" / "llama_cpp" / "lib" / "libllama.dylib"
    for path in (main, lib):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\xcf\xfa\xed\xfe" + bytes(12))
    (app / "Contents" / "Info.plist").write_bytes(b"<plist/>")
    files = macos._macho_files(app)
    assert set(files) == {main, lib}
    assert files.index(lib) < files.index(main)  # deeper first

    cmds = macos.signing_commands(app, "-", files)
    assert all(c[:2] == ["codesign", "--force"] and "runtime" in c for c in cmds)
    assert [c[-1] for c in cmds] == [str(lib), str(main), str(app)]  # the app last
    assert "--entitlements" not in cmds[0]
    assert all("--entitlements" in c for c in cmds[1:])
    assert "--timestamp=none" in cmds[0]  # an ad-hoc signature has no timestamp
    dev = macos.signing_commands(app, "Developer ID Application: X (T)", files)
    assert all("--timestamp" in c for c in dev)  # notarisation requires one
