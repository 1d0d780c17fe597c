"""Typed errors of the engine: each carries a code and one line naming the cause and fix.

The engine never speaks HTTP: an error says what went wrong (``code``); the API maps
codes to statuses (`engine.api.errors`), the CLI prints the line, the app shows it.
"""

from __future__ import annotations

from typing import Literal, get_args


class ShoalError(Exception):
    """A refused command or request. ``str(error)`` is the one line for the user."""

    code = "error"

    def __init__(self, message: str, *, code: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.retry_after = retry_after  # seconds, when trying again later can work

    @property
    def message(self) -> str:
        return str(self)


class StartError(ShoalError):
    """Shoal (or one of its roles) cannot start as asked: a port in use, a model missing
    offline, a token file that is unusable, a runtime that cannot run here."""

    code = "cannot_start"


class RequestError(ShoalError):
    """A request the fleet refuses: a bad prompt, no node, every lane busy, too long."""

    code = "invalid_request"


# The codes a RequestError carries; `engine.api.errors.STATUS` gives each its HTTP status.
RequestCode = Literal[
    "invalid_request",  # the request itself is wrong (an empty prompt, a node refused it)
    "invalid_request_error",  # the chat template refused the messages (the code as answered)
    "context_length_exceeded",  # no node's window holds the prompt
    "fim_unsupported",  # a suffix for a model without fill-in-the-middle tokens
    "node_not_found",  # ?host= names no node of the fleet
    "model_not_found",  # the name is neither a model nor an alias
    "fleet_busy",  # every lane stayed busy for the whole queue timeout
    "no_node_available",  # no node serving the model is linked
    "node_unavailable",  # the node ?host= names is down
    "fleet_paused",  # every node serving the model is paused by its user
    "model_unavailable",  # an alias whose models no node serves now
    "shutting_down",  # the head is stopping (a restart): try again in a moment
    "internal_error",  # a bug: the head's log has the details
]
REQUEST_CODES: frozenset[str] = frozenset(get_args(RequestCode))


class JoinError(ShoalError):
    """Joining a fleet failed: a wrong or stale join code, no head found, another fleet."""

    code = "cannot_join"


class CommandError(ShoalError):
    """A command refused: an alias that cannot be set, a key name not allowed."""

    code = "refused"
