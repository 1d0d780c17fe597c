"""The installer build's own checks, fast and without building: a native llama.cpp never
gets into the bundle, the portable wheel is reused, the desktop entry and the install
script are valid."""

from __future__ import annotations

import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest

from installers import bundle, linux

ROOT = bundle.ROOT
WHEEL_SH = ROOT / "scripts" / "lib" / "llama_wheel.sh"


def _fake_llama(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, libs: list[str]) -> Path:
    pkg = tmp_path / "llama_cpp"
    (pkg / "lib").mkdir(parents=True)
    for name in libs:
        (pkg / "lib" / name).write_bytes(b"\x7fELF")
    module = types.ModuleType("llama_cpp")
    module.__file__ = str(pkg / "__init__.py")
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    monkeypatch.setattr(sys, "platform", "linux")
    return pkg / "lib"


def test_a_native_llama_build_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_llama(monkeypatch, tmp_path, ["libllama.so", "libggml.so", "libggml-cpu.so"])
    with pytest.raises(bundle.BuildError, match=r"native llama\.cpp build"):
        bundle.llama_libs()


def test_a_portable_build_missing_variants_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _fake_llama(monkeypatch, tmp_path, ["libllama.so", "libggml-cpu-x64.so"])
    monkeypatch.setattr(bundle, "expected_variants", lambda: ("x64", "haswell"))
    with pytest.raises(bundle.BuildError, match=r"lacks CPU variants \['haswell'\]"):
        bundle.llama_libs()


def test_the_portable_build_is_taken_without_its_third_copies(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    names = ["libllama.so", "libllama.so.0", "libllama.so.0.5.0", "libllama-common.so",
             "libggml.so", "libggml.so.0", "libggml-base.so.0", "libggml-base.so.0.25.3"]
    variants = [f"libggml-cpu-{v}.so" for v in ("x64", "haswell")]
    lib = _fake_llama(monkeypatch, tmp_path, names + variants)
    monkeypatch.setattr(bundle, "expected_variants", lambda: ("x64", "haswell"))
    libs = bundle.llama_libs()
    assert [p.name for p in libs.core] == [
        "libggml-base.so.0", "libggml.so", "libggml.so.0", "libllama.so", "libllama.so.0"]
    assert [p.name for p in libs.variants] == ["libggml-cpu-haswell.so", "libggml-cpu-x64.so"]
    assert bundle.cpu_variants(lib) == ["haswell", "x64"]


def test_the_gpu_backend_is_taken_as_its_own_list(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    names = ["libllama.so", "libggml.so", "libggml-base.so.0", "libggml-cpu-x64.so"]
    monkeypatch.setattr(bundle, "expected_variants", lambda: ("x64",))
    lib = _fake_llama(monkeypatch, tmp_path, [*names, "libggml-vulkan.so"])
    libs = bundle.llama_libs()
    assert libs.gpu == [lib / "libggml-vulkan.so"]
    # neither a core library nor a CPU variant: it goes to llama_cpp/lib, not beside the
    # executable where ggml's search would load it at start
    assert lib / "libggml-vulkan.so" not in libs.core + libs.variants
    # a build venv without it (SHOAL_BUILD_VULKAN=0) bundles no GPU backend
    (lib / "libggml-vulkan.so").unlink()
    assert bundle.llama_libs().gpu == []


def test_the_deb_recommends_vulkan_and_never_depends_on_it() -> None:
    linked = ["libc6 (>= 2.34)", "libvulkan1 (>= 1.2.131.2)", "libstdc++6 (>= 12)"]
    depends = linux.depends_field(linked)
    text = linux.control_text("1.2.3", "amd64", 1000, depends)
    fields = dict(line.split(": ", 1) for line in text.splitlines()
                  if line and not line.startswith(" "))
    needed = {d.strip().split()[0] for d in fields["Depends"].split(",")}
    assert "libvulkan1" not in needed and "mesa-vulkan-drivers" not in needed
    assert {"libc6", "libstdc++6", "libegl1"} <= needed
    assert fields["Recommends"] == "libvulkan1, mesa-vulkan-drivers"
    assert fields["Package"] == "shoal" and fields["Version"] == "1.2.3"


def test_dpkg_shlibdeps_never_scans_the_gpu_backend(tmp_path: Path) -> None:
    # what it scans becomes Depends: the backend's libvulkan.so.1 would be a hard one
    (tmp_path / "llama_cpp" / "lib").mkdir(parents=True)
    for name in ("shoal", "llama_cpp/lib/libllama.so", "llama_cpp/lib/libggml-vulkan.so"):
        (tmp_path / name).write_bytes(b"\x7fELF")
    (tmp_path / "README").write_text("not an ELF file")
    scanned = {str(p.relative_to(tmp_path)) for p in linux.scanned_files(tmp_path)}
    assert scanned == {"shoal", "llama_cpp/lib/libllama.so"}


def test_expected_variants_by_machine() -> None:
    assert "haswell" in bundle.expected_variants("x86_64")
    assert "x64" in bundle.expected_variants("AMD64")  # the baseline every x86-64 runs
    assert "armv8.0_1" in bundle.expected_variants("aarch64")


def _wheel(path: Path, libs: list[str]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name in libs:
            zf.writestr(f"llama_cpp/lib/{name}", b"")
    return path


def _sh(script: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", f". {WHEEL_SH}; {script}"], capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", **env},
                          check=False)


@pytest.mark.skipif(sys.platform != "linux", reason="the Linux wheel's check")
def test_the_wheel_check_refuses_a_native_wheel(tmp_path: Path) -> None:
    native = _wheel(tmp_path / "native.whl", ["libllama.so", "libggml-cpu.so"])
    portable = _wheel(tmp_path / "portable.whl",
                      ["libllama.so", "libggml-cpu-x64.so", "libggml-cpu-haswell.so"])
    bad = _sh(f"llama_wheel_check {sys.executable} {native}")
    assert bad.returncode != 0 and "not the portable llama.cpp build" in bad.stderr
    assert _sh(f"llama_wheel_check {sys.executable} {portable}").returncode == 0
    assert _sh(f"llama_wheel_check {sys.executable} {portable} 'x64 haswell'").returncode == 0
    # a wheel without a variant it was built to carry
    lacking = _sh(f"llama_wheel_check {sys.executable} {portable} 'x64 skylakex'")
    assert lacking.returncode != 0 and "not the portable llama.cpp build" in lacking.stderr


def test_a_development_build_carries_the_baseline_and_the_best_for_this_cpu() -> None:
    avx2 = frozenset({"sse4_2", "avx", "f16c", "fma", "avx2", "bmi2"})
    assert bundle.dev_variants("x86_64", avx2) == ("x64", "haswell")
    assert bundle.dev_variants("x86_64", avx2 | {"avx512f"}) == ("x64", "skylakex")
    assert bundle.dev_variants("x86_64", avx2 | {"avx512f", "avx512vbmi", "avx512_vnni"}) \
        == ("x64", "icelake")
    assert bundle.dev_variants("x86_64", frozenset({"sse4_2", "avx"})) == ("x64", "sandybridge")
    assert bundle.dev_variants("x86_64", frozenset()) == ("x64", "sse42")
    assert bundle.expected_variants("x86_64", spec="all") == bundle.X86_VARIANTS
    assert bundle.expected_variants("x86_64", spec="x64 zen4") == ("x64", "zen4")
    with pytest.raises(bundle.BuildError, match="does not build here"):
        bundle.expected_variants("x86_64", spec="x64 pentium")


def test_a_development_build_leaves_the_other_variants_out_of_ggml(tmp_path: Path) -> None:
    cmake = tmp_path / "CMakeLists.txt"
    cmake.write_text("if (X)\n    ggml_add_cpu_backend_variant(x64)\n"
                     "    ggml_add_cpu_backend_variant(sse42   SSE42)\n"
                     "    ggml_add_cpu_backend_variant(haswell SSE42 AVX F16C FMA AVX2 BMI2)\n"
                     "endif()\n")
    bundle.keep_variants(cmake, ("x64", "haswell"))
    lines = cmake.read_text().splitlines()
    assert lines[1] == "    ggml_add_cpu_backend_variant(x64)"
    assert lines[2] == "    # (left out) ggml_add_cpu_backend_variant(sse42   SSE42)"
    assert lines[3].startswith("    ggml_add_cpu_backend_variant(haswell")
    with pytest.raises(bundle.BuildError, match=r"builds no CPU variant \['zen4'\]"):
        bundle.keep_variants(cmake, ("x64", "zen4"))


def test_a_built_wheel_is_reused_and_keyed_on_the_options(tmp_path: Path) -> None:
    py = sys.executable
    where = _sh(f'llama_wheel_dir "$(llama_variants {py})"',
                SHOAL_WHEEL_CACHE=str(tmp_path)).stdout.strip()
    assert where.startswith(f"{tmp_path}/portable-")
    wheel = Path(where) / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
    wheel.parent.mkdir(parents=True)
    wheel.write_bytes(b"")
    # present: printed as it is, nothing built (a build would take minutes)
    got = _sh(f"ensure_llama_wheel {py}", SHOAL_WHEEL_CACHE=str(tmp_path))
    assert got.returncode == 0 and got.stdout.strip() == str(wheel), got.stderr
    # other options, another folder: a wheel of other options is never taken for this one
    other = _sh("llama_portable_cmake_args() { echo -DGGML_NATIVE=ON; }; "
                f'llama_wheel_dir "$(llama_variants {py})"',
                SHOAL_WHEEL_CACHE=str(tmp_path)).stdout.strip()
    assert other != where
    # other variants (a release's every one), another folder too
    release = _sh(f'llama_wheel_dir "$(llama_variants {py})"', SHOAL_LLAMA_VARIANTS="all",
                  SHOAL_WHEEL_CACHE=str(tmp_path)).stdout.strip()
    if sys.platform == "linux":
        assert release not in (where, other) and release.startswith(f"{tmp_path}/portable-")
    args = _sh("llama_portable_cmake_args").stdout
    if sys.platform == "linux":
        for option in ("-DGGML_NATIVE=OFF", "-DGGML_BACKEND_DL=ON", "-DGGML_CPU_ALL_VARIANTS=ON"):
            assert option in args


@pytest.mark.skipif(shutil.which("desktop-file-validate") is None,
                    reason="no desktop-file-validate (apt install desktop-file-utils)")
@pytest.mark.parametrize("exec_path", ["/usr/bin/shoal", "@SHOAL@"])
def test_the_desktop_entry_validates(tmp_path: Path, exec_path: str) -> None:
    entry = tmp_path / "shoal.desktop"
    entry.write_text(linux.desktop_text(exec_path))
    out = subprocess.run(["desktop-file-validate", str(entry)], capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    text = entry.read_text()
    assert f"\nExec={exec_path} app\n" in text and f"\nTryExec={exec_path}\n" in text
    assert "\nIcon=shoal\n" in text


def test_the_install_script_parses() -> None:
    out = subprocess.run(["sh", "-n"], input=linux.INSTALL_SH, capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, out.stderr
