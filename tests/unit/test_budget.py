"""The memory budget and the KV pool planned inside it (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.runtimes.budget import (
    CELL_ROUND,
    HOST_CACHE_MAX,
    MIN_CELLS_PER_LANE,
    BudgetTooSmall,
    default_budget_bytes,
    plan_pool,
)
from engine.sizes import GiB, MiB

SMOL = dict(base=100 * MiB, model_bytes=100 * MiB, overhead=80 * MiB,
            kv_bytes_per_token=23_040, n_ctx_train=8192)


def test_default_budget_leaves_the_desktop_usable() -> None:
    assert default_budget_bytes(16 * GiB) == 8 * GiB
    assert default_budget_bytes(8 * GiB) == 4 * GiB
    assert default_budget_bytes(6 * GiB) == 2 * GiB  # 4 GiB left to the desktop
    assert default_budget_bytes(4 * GiB) == 1 * GiB  # never under a quarter
    assert default_budget_bytes(64 * GiB) == 32 * GiB


def test_pool_is_one_window_shared_by_the_lanes() -> None:
    plan = plan_pool(budget=12 * GiB, lanes=8, max_context=None, **SMOL)
    # SmolLM2: 8 lanes share one 8192-cell window (llama-server's -c 8192 --kv-unified),
    # not 8 x 8192 cells, however large the budget
    assert plan.cells == 8192 and plan.window == 8192
    assert plan.kv_bytes == 8192 * 23_040
    assert plan.host_cache_bytes == HOST_CACHE_MAX


def test_pool_holds_at_least_a_share_per_lane() -> None:
    plan = plan_pool(budget=12 * GiB, lanes=8, max_context=512, **SMOL)
    assert plan.window == 512 and plan.cells == 8 * 512  # never more than lanes x window
    plan = plan_pool(budget=12 * GiB, lanes=16, max_context=None, **SMOL)
    assert plan.cells == 16 * MIN_CELLS_PER_LANE and plan.window == 8192


def test_a_small_budget_shrinks_the_window_and_the_host_cache() -> None:
    budget = 280 * MiB + 4000 * 23_040  # room for 4000 cells after model and process
    plan = plan_pool(budget=budget, lanes=8, max_context=None, **SMOL)
    assert plan.cells == 4000 // CELL_ROUND * CELL_ROUND
    assert plan.window == plan.cells
    assert plan.host_cache_bytes == (4000 - plan.cells) * 23_040


def test_a_budget_without_room_for_the_model_is_refused_with_the_fix() -> None:
    with pytest.raises(BudgetTooSmall, match="raise --memory-budget or serve a smaller model"):
        plan_pool(budget=250 * MiB, lanes=8, max_context=None, **SMOL)


def test_a_pinned_window_the_budget_cannot_hold_is_refused() -> None:
    budget = 300 * MiB + 2000 * 23_040
    with pytest.raises(BudgetTooSmall, match="--max-context 4096 needs"):
        plan_pool(budget=budget, lanes=8, max_context=4096, **SMOL)


@given(budget=st.integers(300 * MiB, 64 * GiB), lanes=st.integers(1, 32),
       per_token=st.integers(1_000, 600_000), train=st.integers(0, 131_072))
def test_the_plan_never_exceeds_the_budget(budget: int, lanes: int, per_token: int,
                                           train: int) -> None:
    try:
        plan = plan_pool(budget=budget, base=100 * MiB, model_bytes=100 * MiB,
                         overhead=64 * MiB, kv_bytes_per_token=per_token, lanes=lanes,
                         n_ctx_train=train, max_context=None)
    except BudgetTooSmall:
        assert (budget - 264 * MiB) // per_token < 512
        return
    assert 264 * MiB + plan.kv_bytes + plan.host_cache_bytes <= budget
    assert plan.window <= plan.cells and plan.window >= 1
