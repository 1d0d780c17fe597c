"""Temporary: the runtime calls the roles need, until the runtime registry lands."""

from __future__ import annotations

from pathlib import Path

from engine import core, models
from engine.errors import StartError
from engine.head.prompt import model as head_model
from engine.head.prompt.model import HeadModel
from engine.runtimes.base import Engine


def pick(runtime: str | None, spec: str | None) -> str:
    try:
        return core.pick_runtime(runtime, spec or "")
    except StartError as exc:
        from engine.runtimes.base import RuntimeUnavailable
        raise RuntimeUnavailable(str(exc)) from None


def check(runtime: str) -> None:
    try:
        core.check_runtime(runtime)
    except StartError as exc:
        from engine.runtimes.base import RuntimeUnavailable
        raise RuntimeUnavailable(str(exc)) from None


def resolve_model(runtime: str, spec: str | None, *, home: Path, offline: bool,
                  progress: models.Progress, cancel: models.Cancel) -> tuple[str, str]:
    try:
        return core.resolve_model_path(spec, runtime, home=home, offline=offline,
                                       progress=progress)
    except StartError as exc:
        raise models.ModelMissing(str(exc)) from None


def make_engine(runtime: str, path: str, *, name: str, lanes: int, max_context: int | None,
                mock_speed: float) -> Engine:
    return core.make_engine(runtime, path, name=name, lanes=lanes, max_context=max_context,
                            mock_speed=mock_speed)


def load_head_model(runtime: str, path: str, *, name: str,
                    chat_template: str | None) -> HeadModel:
    return head_model.load_head_model(runtime, path, name=name, chat_template=chat_template)
