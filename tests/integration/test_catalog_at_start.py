"""The model catalog is read and checked when Shoal starts: a user's broken catalog is
said in one line and the bundled one used; a newer valid one is used."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from engine.models.catalog import bundled_catalog_path
from tests.integration.test_service import both, running

pytestmark = pytest.mark.timeout(60)


async def test_a_broken_user_catalog_is_refused_in_one_line_at_start(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "catalog.toml").write_text('version = 99\nupdated = "2026-12-02"\n'
                                           '[[model]]\nid = "x"\n')
    caplog.set_level(logging.WARNING, logger="shoal")
    async with running(both(tmp_path)) as shoal:
        said = [r.getMessage() for r in caplog.records if "catalog.toml" in r.getMessage()]
        assert len(said) == 1 and " is refused (" in said[0]
        assert said[0].endswith("using the bundled catalog v1; fix or remove it")
        catalog, _ = await shoal.models.catalog()
        assert catalog.source == str(bundled_catalog_path())


async def test_a_newer_user_catalog_is_used(tmp_path: Path) -> None:
    text = bundled_catalog_path().read_text().replace("version = 1\n", "version = 2\n", 1)
    (tmp_path / "catalog.toml").write_text(text)
    async with running(both(tmp_path)) as shoal:
        catalog, line = await shoal.models.catalog()
        assert catalog.version == 2 and line.startswith("using ")
        assert catalog.get("qwen2.5-coder-7b-instruct") is not None
