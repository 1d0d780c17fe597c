"""Schema-driven fuzzing of every route of the head from its /openapi.json: no request,
however malformed, may answer 500.

Schemathesis runs as its CLI against an in-process head with a mock node, twice:
over the description as served (every route, random model names) and over a copy
with the model names pinned to the served model, so that generated bodies get past
name resolution into the generation paths.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import shutil
import sys
from pathlib import Path

import aiohttp
import pytest
import schemathesis  # noqa: F401  # the `st` command below comes with it

from tests.integration.test_api_surface import MODEL, live_head

# a busy machine slows schemathesis's own process most: a generous bound, seldom reached
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ST = shutil.which("st", path=str(Path(sys.executable).parent)) or "st"
GENERATING = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
              "/v1/messages/count_tokens", "/api/chat", "/api/generate", "/api/show",
              "/v1/models/{model}")


def pin_models(spec: dict) -> dict:
    """The description with every ``model`` property and parameter fixed to MODEL."""
    spec = copy.deepcopy(spec)
    for schema in spec["components"]["schemas"].values():
        props = schema.get("properties", {})
        if "model" in props:
            props["model"] = {"const": MODEL}
            schema["required"] = sorted({*schema.get("required", []), "model"})
        schema.pop("anyOf", None)
    spec["paths"] = {p: item for p, item in spec["paths"].items() if p in GENERATING}
    for item in spec["paths"].values():
        for op in item.values():
            for param in op.get("parameters", []):
                if param["name"] == "model":
                    param["schema"] = {"const": MODEL}
                if param["name"] == "host":  # a pin to a missing node waits for it
                    param["schema"] = {"const": "n0"}
    return spec


async def run_schemathesis(location: str, base: str, tmp: Path, examples: int) -> str:
    args = [ST, "run", location, "--checks", "not_a_server_error", "--max-examples",
            str(examples), "--seed", "7", "--workers", "1", "--request-timeout", "30",
            "--phases", "examples,coverage,fuzzing", "--no-shrink",
            "--suppress-health-check", "all", "--warnings", "off"]
    if not location.startswith("http"):
        args += ["--url", base]
    proc = await asyncio.create_subprocess_exec(
        *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        cwd=tmp, env={**os.environ, "NO_COLOR": "1"})
    out, _ = await asyncio.wait_for(proc.communicate(), 540)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-6000:]
    return text


async def test_no_route_answers_500(tmp_path: Path, caplog):
    async with live_head(lanes=8, queue_timeout_s=0.6, keepalive_s=0.3) as live:
        async with aiohttp.ClientSession() as http, http.get(live.url("/openapi.json")) as r:
            spec = await r.json()
        base = live.url("")
        # the coverage phase walks every schema's edges whatever the count; the random
        # examples on top are kept few enough for a run of the suite (seconds per route)
        first = await run_schemathesis(live.url("/openapi.json"), base, tmp_path, 4)
        pinned = tmp_path / "pinned.json"
        pinned.write_text(json.dumps(pin_models(spec)))
        second = await run_schemathesis(str(pinned), base, tmp_path, 10)
        async with aiohttp.ClientSession() as http, http.get(live.url("/metrics")) as r:
            metrics = await r.text()
    for text in (first, second):
        assert "passed" in text
    assert 'status="500"' not in metrics
    # the pinned run reached the generation paths
    assert 'route="/v1/chat/completions",method="POST",status="200"' in metrics
    assert 'route="/api/generate",method="POST",status="200"' in metrics
    for route in ("/v1/responses", "/v1/messages", "/v1/messages/count_tokens"):
        assert f'route="{route}",method="POST",status="200"' in metrics, route
    assert "unexpected error" not in caplog.text
