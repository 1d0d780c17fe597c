"""Runtime hook: llama-cpp-python as the ctypes binding only.

The engine uses ``llama_cpp.llama_cpp`` and nothing else of the package. Its ``__init__``
also imports the high-level ``Llama`` class and with it numpy and its BLAS (about 40 MB),
which the bundle leaves out: the package is registered here without running ``__init__``,
so ``import llama_cpp.llama_cpp`` finds the binding in the bundle directly.
"""

import importlib.util
import sys


def _binding_only() -> None:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.submodule_search_locations is None:
        return  # not bundled: the engine says so when a model is loaded
    sys.modules["llama_cpp"] = importlib.util.module_from_spec(spec)


_binding_only()
