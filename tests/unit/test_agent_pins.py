"""The agent upgrade check: every coding agent pinned in scripts/lib/agents.py has the
requests it sends recorded (tests/fixtures/agents/<agent>-<version>/, decoded by
tests/unit/test_agent_requests.py), no folder is left for a version no longer pinned, and
the installed binaries are the pinned versions. Moving a pin fails here, with the one
command that records the new version's requests, so an upgrade lands as a fixture diff."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.lib.agents import PINS, version_of
from tests.agent_fixtures import FIXTURES, REFRESH, fixture_dir

INSTALL = ".venv/bin/python scripts/lib/agents.py"


@pytest.mark.parametrize("agent", PINS, ids=lambda a: a.name)
def test_a_pinned_agent_has_its_requests_recorded(agent):
    folder = fixture_dir(agent.name, agent.version)
    recorded = sorted(folder.glob("*.json"))
    if not recorded:
        pytest.fail(f"{agent.package} is pinned at {agent.version} but {folder} holds no "
                    f"recorded requests; refresh them: {INSTALL} && {REFRESH}", pytrace=False)


def test_no_fixtures_are_left_for_versions_no_longer_pinned():
    pinned = {fixture_dir(a.name, a.version) for a in PINS}
    stale = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir() and p not in pinned)
    assert stale == [], (f"fixtures for agents no longer pinned: {', '.join(stale)}; remove "
                         f"them (git rm -r) once {REFRESH} has recorded the pinned ones")


@pytest.mark.parametrize("agent", PINS, ids=lambda a: a.name)
def test_the_installed_agent_is_the_pinned_version(agent, agent_binaries: dict[str, Path]):
    found = version_of(agent_binaries[agent.name])
    assert found is not None, f"{agent_binaries[agent.name]} --version does not run"
    assert agent.version in found.split(), \
        f"{agent.name} says {found!r}, pinned {agent.version}; reinstall: {INSTALL}"
