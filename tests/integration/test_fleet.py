"""A head and mock nodes as real processes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import stat
import time

import aiohttp
import pytest

from tests.integration.conftest import Cluster, Proc, sse_text
from tests.waiting import until, until_result

pytestmark = pytest.mark.timeout(120)


def url(head: Proc, path: str) -> str:
    return f"http://127.0.0.1:{head.port}{path}"


async def fleet_state(head: Proc) -> dict:
    async with aiohttp.ClientSession() as http, http.get(url(head, "/v1/fleet")) as r:
        assert r.status == 200
        return await r.json()


async def wait_ready(head: Proc, count: int, timeout: float = 20.0) -> dict:
    def enough(state: dict) -> bool:
        return len([n for n in state["nodes"]
                    if n["state"] == "ready" and n["connections"] > 0]) >= count

    return await until_result(lambda: fleet_state(head), enough,
                              what=f"{count} nodes ready", timeout=timeout)


async def idle_state(head: Proc) -> dict | None:
    """The fleet state once every node reports no busy lane (stats after the last
    release), else None: a check for `until`."""
    state = await fleet_state(head)
    nodes = state["nodes"]
    return state if nodes and all(n["lanes_busy"] == 0 for n in nodes) else None


async def busy_lanes(head: Proc, count: int, identity: str | None = None) -> bool:
    """Whether the node (or every node together) reports ``count`` busy lanes."""
    nodes = (await fleet_state(head))["nodes"]
    if identity is not None:
        nodes = [n for n in nodes if n["identity"] == identity]
    return sum(n["lanes_busy"] for n in nodes) >= count


def chat_body(content: str = "hello", **kw: object) -> dict:
    return {"model": "mock-m", "messages": [{"role": "user", "content": content}], **kw}


async def stream_chat(head: Proc, body: dict, *,
                      on_progress=None) -> tuple[str, str | None, dict | None]:
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    raw = []
    seen = 0
    async with aiohttp.ClientSession() as http, \
            http.post(url(head, "/v1/chat/completions"), json=body) as r:
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        async for line in r.content:
            raw.append(line.decode())
            seen += 1
            if on_progress is not None:
                await on_progress(seen)
    return sse_text("".join(raw))


async def test_streaming_chat_through_three_nodes(cluster: Cluster):
    cluster.token()
    nodes = [cluster.node(f"n{i}") for i in range(3)]
    head = cluster.head(nodes)
    await wait_ready(head, 3)
    text, finish, usage = await stream_chat(head, chat_body(max_tokens=40, seed=3))
    assert finish in ("stop", "length")
    assert usage and usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert len(text) == usage["completion_tokens"]  # the mock's tokens are single bytes
    # the same request without streaming gives the same text
    async with aiohttp.ClientSession() as http, \
            http.post(url(head, "/v1/chat/completions"),
                      json=chat_body(max_tokens=40, seed=3)) as r:
        body = await r.json()
    assert body["choices"][0]["message"]["content"] == text
    assert body["usage"] == {k: v for k, v in usage.items()}
    log = head.log_text()
    assert "fleet node 'n0' at" in log and "context window 4096 tokens, 4 lanes" in log
    assert "placed on" in log


async def test_round_robin_spreads_sessions(cluster: Cluster):
    cluster.token()
    nodes = [cluster.node(f"n{i}") for i in range(3)]
    head = cluster.head(nodes, extra=("--fleet-policy", "round-robin"))
    await wait_ready(head, 3)
    async with aiohttp.ClientSession() as http:
        for i in range(9):
            async with http.post(url(head, "/v1/chat/completions"),
                                 json=chat_body(max_tokens=5, seed=i)) as r:
                assert r.status == 200
    state = await fleet_state(head)
    counts = sorted(n["sessions_total"] for n in state["nodes"])
    assert counts == [3, 3, 3], state


async def _failover(cluster: Cluster, how: str) -> None:
    cluster.token()
    nodes = [cluster.node(f"n{i}", speed=150.0) for i in range(3)]
    head = cluster.head(nodes)
    await wait_ready(head, 3)
    body = chat_body("tell me a long story", max_tokens=240, seed=42, temperature=0.7)
    reference, ref_finish, _ = await stream_chat(head, body)
    assert len(reference) > 100
    victim: list[Proc] = []

    async def on_progress(seen: int) -> None:
        if seen == 60 and not victim:
            state = await fleet_state(head)
            busy = [n for n in state["nodes"] if n["own_sessions"] > 0]
            assert len(busy) == 1, state
            proc = next(p for p in nodes if p.address == busy[0]["address"])
            proc.signal(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
            victim.append(proc)

    text, finish, usage = await stream_chat(head, body, on_progress=on_progress)
    assert victim, "the stream ended before the node could be stopped"
    assert text == reference  # nothing twice, nothing missing
    assert finish == ref_finish
    assert usage["completion_tokens"] == len(reference)
    log = head.log_text()
    assert "moved from" in log
    if how == "stop":
        assert "treating the node as hung" in log
        victim[0].signal(signal.SIGCONT)


async def test_failover_after_sigkill_mid_stream(cluster: Cluster):
    await _failover(cluster, "kill")


async def test_failover_after_sigstop_mid_stream(cluster: Cluster):
    await _failover(cluster, "stop")


@pytest.mark.slow
async def test_restarted_node_is_picked_up_again(cluster: Cluster):
    cluster.token()
    node = cluster.node("n0")
    port = node.port
    head = cluster.head([node])
    await wait_ready(head, 1)
    node.signal(signal.SIGKILL)
    node.popen.wait(5)
    await until_result(lambda: fleet_state(head),
                       lambda state: state["nodes"][0]["state"] == "unreachable",
                       what="the killed node unreachable")
    assert "retrying it every 10 s" in head.log_text()
    cluster.node("n0", port=port)
    await wait_ready(head, 1, timeout=15)
    async with aiohttp.ClientSession() as http, \
            http.post(url(head, "/v1/chat/completions"), json=chat_body(max_tokens=5)) as r:
        assert r.status == 200


POOL_KEYS = ("kv_parked", "max_prompt", "mem_used", "mem_budget", "prompt_from_lanes",
             "prompt_from_host", "prompt_prefilled")


async def test_the_fleet_view_carries_each_nodes_pool_report(cluster: Cluster):
    cluster.token()
    head = cluster.head([cluster.node("n0")])
    await wait_ready(head, 1)
    async with aiohttp.ClientSession() as http, \
            http.post(url(head, "/v1/chat/completions"), json=chat_body(max_tokens=5)) as r:
        assert r.status == 200
    (entry,) = (await until(lambda: idle_state(head), "the node's stats after it"))["nodes"]
    # what the node says of its KV pool, memory and prompt tokens, as counts (the mock
    # node's own values: test_fleet_pool shows the head passing on any it is given)
    assert {k: type(entry[k]) for k in POOL_KEYS} == dict.fromkeys(POOL_KEYS, int), entry
    assert entry["sleep"] == ""  # a mock node never sleeps
    async with aiohttp.ClientSession() as http, http.get(url(head, "/metrics")) as r:
        text = await r.text()
    for family in ("shoal_node_kv_parked", "shoal_node_memory_used_bytes",
                   "shoal_node_memory_budget_bytes"):
        assert re.search(rf'^{family}{{node="n0",[^}}]*}} \d+$', text, re.M), family
    for source in ("lane", "host", "prefill"):
        assert re.search(rf'^shoal_node_prompt_tokens_total{{node="n0",[^}}]*'
                         rf'source="{source}"}} \d+$', text, re.M), source


async def test_two_heads_share_one_lane_nodes_without_exceeding_lanes(cluster: Cluster):
    cluster.token()
    nodes = [cluster.node(f"n{i}", lanes=1, speed=400.0) for i in range(2)]
    heads = [cluster.head(nodes), cluster.head(nodes)]
    for h in heads:
        await wait_ready(h, 2)

    async def one(head: Proc, i: int) -> int:
        async with aiohttp.ClientSession() as http, \
                http.post(url(head, "/v1/chat/completions"),
                          json=chat_body(max_tokens=40, seed=i)) as r:
            await r.read()
            return r.status

    statuses = await asyncio.gather(*(one(heads[i % 2], i) for i in range(12)))
    assert statuses == [200] * 12
    # the nodes' stats after their last release: never more than one lane busy at once
    state = await until(lambda: idle_state(heads[0]), "both nodes to report idle")
    assert [n["peak_busy"] for n in state["nodes"]] == [1, 1], state
    # both heads placed sessions on the shared nodes (a head that finds a node full from
    # the other head's session tries the next one: test_node_and_sessions shows it)
    for h in heads:
        placed = h.log_text().count("placed on '")
        full = h.log_text().count("is full (")
        # six sessions each, placed once more for every refusal by a full node
        assert placed == 6 + full, h.log_text()[-2000:]


async def test_wrong_token_is_refused_at_the_handshake(cluster: Cluster, tmp_path):
    cluster.token()
    other = tmp_path / "other-token"
    other.write_text("ab" * 32)
    other.chmod(0o600)  # a token file open to other users is refused
    node = cluster.node("n0", extra=("--auth-file", str(other)))
    head = cluster.head([node])
    await until(lambda: "closed the connection at the handshake" in head.log_text()
                and "another fleet token" in node.log_text(), "both ends to log the refusal")
    assert ("closed the connection at the handshake; check that --fleet-auth holds the token "
            "in the node's --auth-file") in head.log_text()
    assert "the peer holds another fleet token; give the node's --auth-file the same token" \
        in node.log_text()
    token = (cluster.home / "fleet" / "token").read_text().strip()
    assert token not in head.log_text() + node.log_text()
    state = await fleet_state(head)
    assert state["nodes"][0]["state"] == "unreachable"


async def test_full_fleet_queues_then_answers_429(cluster: Cluster):
    cluster.token()
    node = cluster.node("n0", lanes=1, speed=50.0)
    head = cluster.head([node], extra=("--queue-timeout", "2"))
    await wait_ready(head, 1)

    async def chat(max_tokens: int) -> tuple[int, dict, float]:
        t0 = time.monotonic()
        async with aiohttp.ClientSession() as http, \
                http.post(url(head, "/v1/chat/completions"),
                          json=chat_body(max_tokens=max_tokens, seed=1, temperature=0)) as r:
            headers = {**r.headers, "__body__": await r.text()}
            return r.status, headers, time.monotonic() - t0

    long = asyncio.create_task(chat(400))  # ~8 s on the only lane
    await until(lambda: busy_lanes(head, 1), "the long request to take the only lane")
    status, headers, _waited = await chat(5)
    body = json.loads(headers.pop("__body__"))
    # fleet_busy is the answer of a request that queued until the queue timeout ended
    assert status == 429 and body["error"]["code"] == "fleet_busy"
    assert int(headers["Retry-After"]) >= 1
    assert "stayed busy for 2 s" in body["error"]["message"]
    long.cancel()

    # a short queue wait that ends when the lane frees
    node2 = cluster.node("n1", lanes=1, speed=200.0)
    head2 = cluster.head([node2], extra=("--queue-timeout", "10"))
    await wait_ready(head2, 1)
    async with aiohttp.ClientSession() as http:
        async def go(i: int) -> int:
            async with http.post(url(head2, "/v1/chat/completions"),
                                 json=chat_body(max_tokens=100, seed=i)) as r:
                await r.read()
                return r.status
        assert await asyncio.gather(*(go(i) for i in range(3))) == [200, 200, 200]


async def test_bad_input_gets_clear_4xx(cluster: Cluster):
    cluster.token()
    node = cluster.node("n0", extra=("--max-context", "256"))
    head = cluster.head([node])
    await wait_ready(head, 1)
    cases: list[tuple[object, int, str]] = [
        (b"{not json", 400, "not valid JSON"),
        (b"[]", 400, "invalid request"),
        ({"messages": [{"role": "user", "content": "x"}]}, 400, "model"),
        ({"model": "mock-m"}, 400, "messages"),
        ({"model": "mock-m", "messages": "hi"}, 400, "messages"),
        (chat_body(temperature="hot"), 400, "temperature"),
        (chat_body(max_tokens=-3), 400, "max_tokens"),
        ({"model": "mock-m", "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
        ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "nope"),
        (chat_body(n=2), 400, "n other than 1"),
        (chat_body(logprobs=True), 400, "logprobs"),
        (chat_body(logit_bias={"5": 1.0}), 400, "logit_bias"),
        ({"model": "mock-m", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "image_url"),
        (chat_body("x" * 2000), 400, "context window"),
        (b"x" * (9 * 1024 * 1024), 413, "larger than"),
    ]
    async with aiohttp.ClientSession() as http:
        for body, status, words in cases:
            kw = {"data": body} if isinstance(body, bytes) else {"json": body}
            async with http.post(url(head, "/v1/chat/completions"), **kw) as r:
                text = await r.text()
                shown = body[:40] if isinstance(body, bytes) else body
                assert r.status == status, (shown, text)
                err = json.loads(text)["error"]
                assert set(err) >= {"message", "type", "code"}
                assert words in err["message"], (words, err)
                assert "Traceback" not in text
        async with http.get(url(head, "/v1/nothing")) as r:
            assert r.status == 404 and "error" in await r.json()
        async with http.get(url(head, "/v1/chat/completions")) as r:
            assert r.status == 405 and "error" in await r.json()
        # and the head keeps serving
        async with http.post(url(head, "/v1/chat/completions"),
                             json=chat_body(max_tokens=3)) as r:
            assert r.status == 200
        async with http.get(url(head, "/v1/models")) as r:
            assert (await r.json())["data"][0]["id"] == "mock-m"
        async with http.get(url(head, "/health")) as r:
            assert (await r.json())["status"] == "ok"
    assert "Traceback" not in head.log_text()


async def test_stop_and_max_tokens(cluster: Cluster):
    cluster.token()
    head = cluster.head([cluster.node("n0")])
    await wait_ready(head, 1)
    async with aiohttp.ClientSession() as http:
        async with http.post(url(head, "/v1/chat/completions"),
                             json=chat_body(max_tokens=30, seed=5, temperature=0.5)) as r:
            full = (await r.json())["choices"][0]
        assert full["finish_reason"] == "length" and len(full["message"]["content"]) == 30
        stop_at = full["message"]["content"][10:12]
        async with http.post(url(head, "/v1/chat/completions"),
                             json=chat_body(max_tokens=30, seed=5, temperature=0.5,
                                            stop=[stop_at])) as r:
            cut = (await r.json())["choices"][0]
        assert cut["finish_reason"] == "stop"
        assert cut["message"]["content"] == full["message"]["content"].split(stop_at)[0]


def test_fleet_token_is_made_once_with_mode_0600(cluster: Cluster):
    first = cluster.token()
    assert re.fullmatch(r"[0-9a-f]{64}", first), first  # 32 bytes, as hex
    path = cluster.home / "fleet" / "token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text().strip() == first  # the token the fleet uses is the one shown
    assert cluster.token() == first
    rotated = cluster.token("--rotate")
    assert rotated != first and cluster.token() == rotated
    assert re.fullmatch(r"[0-9a-f]{64}", rotated) and path.read_text().strip() == rotated


def test_node_refuses_off_loopback_without_token(cluster: Cluster):
    import subprocess

    from tests.integration.conftest import SHOAL

    out = subprocess.run([*SHOAL, "node", "--runtime", "mock", "--model", "m",
                          "--listen", "0.0.0.0:0"], env=cluster.env, capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 2
    assert "refusing to listen on 0.0.0.0:0 without a fleet token" in out.stderr
    assert "Traceback" not in out.stderr


async def test_serve_without_fleet_runs_head_and_embedded_node(cluster: Cluster):
    head = cluster.head([])
    await wait_ready(head, 1)
    assert "serving the built-in mock engine as the local node" in head.log_text()
    text, finish, _usage = await stream_chat(head, chat_body(max_tokens=8, seed=1))
    assert len(text) == 8 and finish == "length"
    (only,) = (await fleet_state(head))["nodes"]
    # its user's name for the machine (its host name), not "<host> (local)"
    assert only["identity"] == socket.gethostname() and only["model"] == "mock-m"


async def test_head_warns_about_a_node_serving_another_model(cluster: Cluster):
    cluster.token()
    good, other = cluster.node("good"), cluster.node("odd", model="other-model")
    head = cluster.head([good, other], extra=("--fleet-policy", "round-robin"))
    await wait_ready(head, 2)
    assert "fleet node 'odd' at" in head.log_text()
    assert "serves 'other-model', not 'mock-m'" in head.log_text()
    async with aiohttp.ClientSession() as http:
        for i in range(4):
            async with http.post(url(head, "/v1/chat/completions"),
                                 json=chat_body(max_tokens=3, seed=i)) as r:
                assert r.status == 200
    nodes = {n["identity"]: n for n in (await fleet_state(head))["nodes"]}
    assert nodes["good"]["sessions_total"] == 4 and nodes["odd"]["sessions_total"] == 0


async def test_conns_per_node_limits_concurrent_generations(cluster: Cluster):
    cluster.token()
    node = cluster.node("n0", lanes=4, speed=100.0)
    head = cluster.head([node], extra=("--fleet-conns-per-node", "1", "--queue-timeout", "10"))
    await wait_ready(head, 1)
    assert (await fleet_state(head))["nodes"][0]["connections"] == 1
    async with aiohttp.ClientSession() as http:
        async def go(i: int) -> int:
            async with http.post(url(head, "/v1/chat/completions"),
                                 json=chat_body(max_tokens=20, seed=i)) as r:
                await r.read()
                return r.status
        assert await asyncio.gather(*(go(i) for i in range(3))) == [200] * 3
    state = await until(lambda: idle_state(head), "the node to report idle")
    assert state["nodes"][0]["peak_busy"] == 1


async def test_routing_hints_pin_and_prefer(cluster: Cluster):
    cluster.token()
    nodes = [cluster.node(f"n{i}", lanes=1, speed=200.0) for i in range(3)]
    head = cluster.head(nodes, extra=("--queue-timeout", "2"))
    await wait_ready(head, 3)
    async with aiohttp.ClientSession() as http:
        async def ask(query: str = "", headers: dict | None = None, **kw: object):
            async with http.post(url(head, "/v1/chat/completions" + query), headers=headers,
                                 json=chat_body(max_tokens=kw.pop("n", 4), **kw)) as r:
                await r.read()
                return r.status, r.headers.get("X-Shoal-Node")

        for _ in range(3):  # a pin always lands on the named node
            assert await ask("?host=n2") == (200, "n2")
        assert await ask("?prefer=n1,n0") == (200, "n1")
        assert await ask("", headers={"X-Shoal-Prefer": "n0"}) == (200, "n0")
        # a preferred node that is busy is passed over, never waited for
        busy = asyncio.create_task(ask("?host=n1", n=300, seed=4))
        await until(lambda: busy_lanes(head, 1, "n1"), "n1 to be busy")
        status, node = await ask("?prefer=n1")
        # answered elsewhere while n1 was still busy: it did not wait for n1
        assert status == 200 and node != "n1" and not busy.done()
        # a name the fleet does not know is passed over too, and a pin to it is refused
        assert (await ask("?prefer=ghost,n2"))[1] == "n2"
        status, _ = await ask("?host=ghost")
        assert status == 404
        await busy
