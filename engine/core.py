"""Choosing and loading a runtime (until the runtime registry replaces these)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from engine.errors import StartError
from engine.runtimes.base import Engine, RuntimeUnavailable

log = logging.getLogger("shoal")
models_progress = Callable[[str, int, int], None]


def pick_runtime(runtime: str | None, model: str) -> str:
    if runtime:
        if runtime not in ("llamacpp", "mlx", "mock"):
            raise StartError(f"unknown runtime '{runtime}'; use llamacpp, mlx or mock")
        return runtime
    return "llamacpp"


def resolve_model_path(spec: str | None, runtime: str, *, home: Path, offline: bool,
                       progress: models_progress | None = None) -> tuple[str, str]:
    """(path or name the runtime loads, the model's name on the link)."""
    if runtime == "mock":
        name = spec or "mock"
        return name, name
    from engine import models

    if runtime == "mlx":
        # MLX loads a model folder or a repo already in the Hugging Face cache itself
        check_runtime(runtime)
        if spec is None:
            raise StartError("runtime mlx has no embedded default model; give an MLX model "
                             "folder or repo id, or use --runtime llamacpp")
        return spec, models.model_name(spec)

    try:
        if spec is None:
            path = models.ensure_embedded_default(home, offline=offline, progress=progress)
            return str(path), models.EMBEDDED_NAME
        path = models.resolve_model(spec, home=home, offline=offline, progress=progress)
    except models.ModelMissing as exc:
        raise StartError(str(exc)) from None
    return str(path), models.model_name(spec)


def check_runtime(runtime: str) -> None:
    """Refuse an unusable runtime before any slow work (pulls, loads)."""
    if runtime == "mlx":
        from engine.runtimes.mlx import check_available

        try:
            check_available()
        except RuntimeUnavailable as exc:
            raise StartError(str(exc)) from None


def make_engine(runtime: str, model: str, *, name: str, lanes: int, max_context: int | None,
                mock_speed: float = 0.0) -> Engine:
    if runtime == "mock":
        from engine.runtimes.mock import MockEngine

        return MockEngine(model=name, lanes=lanes, context_window=max_context or 4096,
                          speed=mock_speed)
    if runtime == "llamacpp":
        from engine.runtimes.llamacpp import LlamaCppEngine

        return LlamaCppEngine(model, model_name=name, lanes=lanes, max_context=max_context)
    if runtime == "mlx":
        from engine.runtimes.mlx import MlxEngine

        mlx_engine: Engine = MlxEngine(model, model_name=name, lanes=lanes,
                                       max_context=max_context)
        return mlx_engine
    raise StartError(f"unknown runtime '{runtime}'")
