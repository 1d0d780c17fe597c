"""The pure answer to a head that asks this node to serve another model
(`engine.service.fleet_choice.answer_at_once`): each refusal names where to choose
instead, a model served already is taken at once, and anything else waits for room."""

from __future__ import annotations

from engine.service.fleet_choice import STOPPING, answer_at_once
from engine.settings import NodeSettings

SPEC = "org/repo:Q4_K_M"
NODE = NodeSettings(fleet_may_choose_model=True)


def ask(node: NodeSettings | None = NODE, *, stopping: bool = False,
        switching_to: str | None = None, serving: str | None = "other/model:Q8_0"):
    return answer_at_once(SPEC, node, stopping=stopping, switching_to=switching_to,
                          serving=serving)


def test_a_stopping_machine_or_one_without_a_node_refuses():
    assert ask(stopping=True) == (False, STOPPING)
    assert ask(None) == (False, STOPPING)


def test_the_owners_choice_and_an_upstream_engine_are_kept():
    taken, line = ask(NodeSettings(fleet_may_choose_model=False))
    assert not taken and "Let the fleet choose this machine's model" in line
    taken, line = ask(NodeSettings(fleet_may_choose_model=True,
                                   upstream="http://127.0.0.1:8080"))
    assert not taken and "fronts the engine at http://127.0.0.1:8080" in line


def test_one_switch_at_a_time():
    taken, line = ask(switching_to="third/model:Q4_0")
    assert not taken and "switching to third/model:Q4_0 already" in line


def test_a_model_served_already_is_taken_at_once_and_another_waits_for_room():
    assert ask(serving=SPEC) == (True, f"serves {SPEC} already")
    assert ask() is None
    assert ask(serving=None) is None


def test_a_model_served_whole_is_asked_again_split_and_a_split_served_so_is_taken():
    split = ("desk:8455",)
    assert answer_at_once(SPEC, NODE, stopping=False, switching_to=None, serving=SPEC,
                          split_with=split) is None
    served_split = NodeSettings(fleet_may_choose_model=True, split_with=split)
    assert answer_at_once(SPEC, served_split, stopping=False, switching_to=None,
                          serving=SPEC, split_with=split) == (
        True, f"serves {SPEC} already split with desk:8455")
    assert answer_at_once(SPEC, served_split, stopping=False, switching_to=None,
                          serving=SPEC) is None  # asked whole again
