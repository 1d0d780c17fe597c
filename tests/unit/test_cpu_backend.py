"""The CPU backend of a portable llama.cpp build, chosen the way ggml chooses it."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest

from engine.runtimes import cpu_backend, llamacpp
from engine.runtimes.cpu_quirks import cpu_flags

binding = pytest.importorskip("llama_cpp.llama_cpp")
LIB = cpu_backend.lib_dir(binding)
VARIANTS = cpu_backend.variant_libraries(LIB)
needs_variants = pytest.mark.skipif(
    not VARIANTS, reason="this llama.cpp is a native build (no CPU variants to choose from)")


@needs_variants
def test_the_best_variant_this_cpu_runs_is_chosen() -> None:
    scores = {p.name: cpu_backend.score(p) for p in VARIANTS}
    assert scores["libggml-cpu-x64.so"] > 0  # the baseline runs anywhere
    best = cpu_backend.best_variant(LIB)
    assert best is not None and scores[best.name] == max(scores.values())
    if "avx2" in cpu_flags():
        assert best.name != "libggml-cpu-x64.so", scores


def test_a_folder_without_variants_chooses_none(tmp_path: Path) -> None:
    assert cpu_backend.variant_libraries(tmp_path) == []
    assert cpu_backend.best_variant(tmp_path) is None
    assert cpu_backend.best_variant(tmp_path / "missing") is None


@needs_variants
def test_a_library_that_is_no_variant_scores_nothing(tmp_path: Path) -> None:
    # a real shared library without ggml_backend_score, named like a variant
    fake = tmp_path / "libggml-cpu-fake.so"
    shutil.copy(LIB / "libggml-base.so", fake)
    assert cpu_backend.score(fake) == 0
    (tmp_path / "libggml-cpu-broken.so").write_bytes(b"not an ELF file")
    assert cpu_backend.score(tmp_path / "libggml-cpu-broken.so") == 0
    assert cpu_backend.best_variant(tmp_path) is None


@needs_variants
def test_the_runtime_loads_it_into_the_registry_llama_cpp_reads() -> None:
    llamacpp.check_available()  # loads the binding and the CPU backend once
    from llama_cpp import _ggml

    ggml = cpu_backend.ggml_in_use(LIB, _ggml.libggml)
    reg = ggml.ggml_backend_reg_by_name
    reg.argtypes, reg.restype = [ctypes.c_char_p], ctypes.c_void_p
    assert reg(b"CPU"), "no CPU backend in the registry libllama uses"
    # loading again is a no-op once it is there
    assert cpu_backend.load_cpu_variant(LIB, ggml) is None
