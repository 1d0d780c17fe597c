"""The head: its model, its fleet, its session runner, and what it counts."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from engine.head.fleet import Fleet
from engine.head.model import HeadModel
from engine.head.sessions import SessionRunner


@dataclass
class Metrics:
    requests: int = 0
    completion_tokens: int = 0


class Head:
    def __init__(self, model: HeadModel, fleet: Fleet, runner: SessionRunner, *,
                 tool_parser: str | None = None) -> None:
        self.model = model
        self.fleet = fleet
        self.runner = runner
        self.tool_parser = tool_parser
        self.metrics = Metrics()
        self.started_wall = int(time.time())

    def serves(self, name: str) -> bool:
        return name == self.model.name

    def fleet_snapshot(self) -> dict[str, Any]:
        return {"model": self.model.name, "context_window": self.fleet.context_window(),
                "queued": self.runner.queued, "moves": self.runner.moves_total,
                "nodes": [p.describe() for p in self.fleet.pools.values()]}

    async def close(self) -> None:
        await self.fleet.close()
