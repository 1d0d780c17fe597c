"""The `Shoal` object (``shoal``) and what its commands return (``results``, ``keys``):
the engine's public API, which the CLI, the tests and the desktop app drive."""

from engine.service.keys import KeyCommands
from engine.service.results import JoinResult, MachineMemory, Pairing, SettingsChange
from engine.service.shoal import Shoal

__all__ = ["JoinResult", "KeyCommands", "MachineMemory", "Pairing", "SettingsChange", "Shoal"]
