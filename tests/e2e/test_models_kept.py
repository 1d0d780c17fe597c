"""The models kept on a machine, with a real node serving one: `shoal.models` and the
`shoal models` CLI (another process) list it as served, refuse to remove it while it is,
and remove it once the node serves another model."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.errors import CommandError
from engine.models import embedded, ids
from engine.settings import NodeSettings
from tests.integration.test_service import both, ready, running

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


async def cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`shoal models ARGS` in another process (waited for off the loop)."""
    env = {**os.environ, "SHOAL_HOME": str(home)}
    return await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "engine.cli", "models", *args], env=env,
        capture_output=True, text=True, timeout=120, check=False)


def put_embedded(home: Path, source: Path) -> Path:
    """The embedded default in ``home``'s cache, as the first run leaves it."""
    target = ids.models_dir(home) / "embedded" / embedded.EMBEDDED_FILE
    target.parent.mkdir(parents=True)
    shutil.copyfile(source, target)
    shutil.copyfile(source.with_name(source.name + ".sha256"),
                    target.with_name(target.name + ".sha256"))
    return target


async def test_a_served_model_is_kept_until_the_node_serves_another(
        tmp_path: Path, smollm2_gguf: Path) -> None:
    home = tmp_path / "home"
    target = await asyncio.to_thread(put_embedded, home, smollm2_gguf)
    settings = both(home)
    settings = settings.with_node(NodeSettings(model=None, runtime="llamacpp", lanes=1,
                                               gpu="off"))
    async with running(settings) as shoal:
        await ready(shoal)
        kept = {m.name: m for m in await shoal.models.kept()}
        served = kept[embedded.EMBEDDED_NAME]
        assert served.served_by == ("this machine",) and served.last_used is not None
        assert served.size == target.stat().st_size
        with pytest.raises(CommandError, match=r"is being served on this machine") as refused:
            await shoal.models.remove(embedded.EMBEDDED_NAME)
        assert refused.value.code == "model_in_use" and target.exists()
        # another process, the CLI, sees the same and says so in one line
        out = await cli(home, "rm", embedded.EMBEDDED_NAME)
        assert out.returncode == 2 and target.exists()
        assert out.stderr.startswith(f"shoal: {embedded.EMBEDDED_NAME} is being served on this "
                                     f"machine (pid {os.getpid()}); switch")
        listed = await cli(home, "list", "--head", "127.0.0.1:9")
        assert listed.returncode == 0
        assert f"pid {os.getpid()}" in listed.stdout.splitlines()[1]
        await shoal.set_model("mock-m", runtime="mock")
        assert (await shoal.models.kept())[0].served_by == ()
        gone = await cli(home, "rm", embedded.EMBEDDED_NAME)
        assert gone.returncode == 0 and gone.stdout.startswith(
            f"removed {embedded.EMBEDDED_NAME} (")
        assert not target.exists() and await shoal.models.kept() == []
