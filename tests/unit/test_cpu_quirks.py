"""llama.cpp's weight repacking is kept off on CPUs with AMX (engine/runtimes/cpu_quirks.py)."""

from __future__ import annotations

import pytest

from engine.runtimes.cpu_quirks import repack_allowed

SPR = frozenset({"avx2", "avx512f", "amx_tile", "amx_int8", "amx_bf16"})
ZEN4 = frozenset({"avx2", "avx512f", "avx512_bf16"})


@pytest.mark.parametrize(("flags", "env", "allowed"), [
    (SPR, None, False),  # AMX: llama.cpp's AMX matrix multiply crashes there
    (frozenset({"amx_int8"}), None, False),
    (ZEN4, None, True),
    (frozenset(), None, True),  # no /proc/cpuinfo (macOS): Metal, or repack as llama.cpp does
    (SPR, "1", True),  # the user says it works on their machine
    (ZEN4, "0", False),
    (ZEN4, "off", False),
    (SPR, "", False),  # an empty variable is no choice
])
def test_repacking_is_off_on_amx_unless_asked(flags: frozenset[str], env: str | None,
                                             allowed: bool):
    assert repack_allowed(flags, env) is allowed
