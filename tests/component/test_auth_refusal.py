"""Every socket the project opens binds loopback unless configured, and off loopback refuses a client that
does not authenticate (issue 17, "Exposure"; README "Guarantees"): the weight broadcast (ZeroMQ CURVE,
learner/weight_publisher.py) and the retrieval service (a bearer token, actors/envs/retrieval_server.py).
The servers here really bind 0.0.0.0 (every interface, what a cluster needs) and are reached on 127.0.0.1.

Refusal is observed, not waited out: a ZeroMQ client's monitor reports each failed CURVE handshake (the
test waits, with a deadline, for two: the first attempt and a reconnect), and only then are the client's and
the publisher's counters read; ZeroMQ delivers no message on a connection whose handshake failed, so
nothing can arrive later through those attempts. HTTP refusals are answers (401) and are simply read.
"""

from __future__ import annotations

import http.client
import json

import pytest
import zmq

from actors.envs.retrieval_server import RetrievalServer
from configs.schema import ConfigError, load_config
from learner.weight_publisher import WeightPublisher
from runtime import retrieval_actor
from tests import weight_fixtures
from tests.waiting import wait_until
from tests.weight_fixtures import CHUNK_MB, WAIT_MS, assert_weights, handshake_failures, weights

subscriber = weight_fixtures.subscriber


def test_every_socket_binds_loopback_by_default():
    cfg = load_config()
    assert (cfg.weights.bind_host, cfg.weights.auth) == ("127.0.0.1", "none")
    with WeightPublisher() as pub:
        assert pub.endpoint == f"tcp://127.0.0.1:{pub.port}" and pub.port > 0  # port 0: bound, read back
    server = RetrievalServer(None)
    try:
        assert server.url == f"http://127.0.0.1:{server.port}" and server.port > 0
    finally:
        server.stop()
    with pytest.raises(ConfigError, match=r"^weights\.auth = 'none' is invalid: expected 'curve' when"):
        load_config(overrides=["weights.bind_host=0.0.0.0"])  # refused before anything starts
    with pytest.raises(ValueError, match=r"^refusing to bind '0\.0\.0\.0' without auth='curve'"):
        WeightPublisher(bind_host="0.0.0.0")
    with pytest.raises(PermissionError, match=r"^binding 0\.0\.0\.0 \(not loopback\) needs a token"):
        RetrievalServer(None, host="0.0.0.0")


def test_a_curve_publisher_off_loopback_refuses_peers_without_its_key(subscriber):
    with WeightPublisher(bind_host="0.0.0.0", auth="curve", chunk_mb=CHUNK_MB) as pub:
        endpoint = f"tcp://127.0.0.1:{pub.port}"
        pub.publish(weights(1), 1)
        good = subscriber(endpoint, server_public_key=pub.public_key, transport="tcp")
        assert_weights(good.poll(WAIT_MS), 1)
        # refresh_s: LATEST is re-sent every 50 ms while no publisher accepts them; a refused DEALER has no
        # peer, and a blocking send there would hang poll(0) (it did: the subscriber now never blocks)
        strangers = {
            "no key (plain ZeroMQ)": subscriber(endpoint, transport="tcp", refresh_s=0.05),
            "a wrong server key": subscriber(
                endpoint, server_public_key=zmq.curve_keypair()[0], transport="tcp", refresh_s=0.05
            ),
        }
        for who, sub in strangers.items():
            with handshake_failures(sub._sock, endpoint) as failed:
                wait_until(lambda f=failed, s=sub: s.poll(0) is None and f() >= 1)  # refused, under watch
            assert sub.stats()["received"] == 0 and sub.version == -1, (who, sub.stats())
        pub.publish(weights(2), 2)  # announced to every known peer: the strangers are not among them
        assert_weights(good.poll(WAIT_MS), 2)
        assert pub.stats()["peers"] == 1  # the publisher never heard a single message from a stranger
        assert all(s.poll(0) is None and s.stats()["received"] == 0 for s in strangers.values())


class Spy:
    """An index that records every search: a refused request must never reach it."""

    def __init__(self) -> None:
        self.queries: list[str] = []

    def __len__(self) -> int:
        return 1

    def search(self, queries, topk):
        self.queries += queries
        return [[{"id": "p1", "contents": "the passage", "score": 1.0}] for _ in queries]


def call(port: int, method: str, path: str, headers: dict[str, str]) -> tuple[int, dict, str | None]:
    """(status, JSON body, WWW-Authenticate header) of one request to 127.0.0.1:port."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        body = json.dumps({"queries": ["q"], "topk": 1}).encode() if method == "POST" else None
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **headers})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read()), resp.getheader("WWW-Authenticate")
    finally:
        conn.close()


TOKEN = "s3cret-token"
CREDENTIALS = {
    "none": {},
    "a wrong token": {"Authorization": "Bearer wrong"},
    "the token without 'Bearer'": {"Authorization": TOKEN},
    "another scheme": {"Authorization": f"Basic {TOKEN}"},
    "a prefix of the token": {"Authorization": f"Bearer {TOKEN[:-1]}"},
    "the token and more": {"Authorization": f"Bearer {TOKEN}x"},
    "an empty bearer": {"Authorization": "Bearer "},
}
ROUTES = [("POST", "/retrieve"), ("GET", "/health"), ("POST", "/other"), ("GET", "/other")]


def test_the_retrieval_service_off_loopback_refuses_every_request_without_its_token():
    spy = Spy()
    server = RetrievalServer(spy, host="0.0.0.0", token=TOKEN).start()
    try:
        for who, headers in CREDENTIALS.items():
            for method, path in ROUTES:
                status, body, challenge = call(server.port, method, path, headers)
                assert (status, challenge) == (401, "Bearer"), (who, method, path, status)
                assert body == {"error": "missing or wrong token (send Authorization: Bearer <token>)"}
        assert spy.queries == []  # no refused request reached the index
        auth = {"Authorization": f"Bearer {TOKEN}"}
        status, body, _ = call(server.port, "POST", "/retrieve", auth)
        assert status == 200 and body == {"result": [[{"id": "p1", "contents": "the passage"}]]}
        assert call(server.port, "GET", "/health", auth)[:2] == (
            200,
            {"ok": True, "passages": 1, "index": "Spy"},
        )
        assert spy.queries == ["q"]
    finally:
        server.stop()


def test_a_run_on_a_cluster_gives_its_retrieval_service_a_token(monkeypatch):
    """runtime/retrieval_actor.py: one node binds loopback (no token needed); more than one binds the node's
    address, always with a token: the configured one, $TREEOPSD_RETRIEVER_TOKEN, or a fresh random one."""
    cfg = load_config()
    monkeypatch.delenv("TREEOPSD_RETRIEVER_TOKEN", raising=False)
    nodes = [{"Alive": True}]
    monkeypatch.setattr(retrieval_actor.ray, "nodes", lambda: nodes)
    assert retrieval_actor._bind(cfg) == ("127.0.0.1", None)
    nodes.append({"Alive": True})
    host, token = retrieval_actor._bind(cfg)
    assert host == "node" and isinstance(token, str) and len(token) >= 32  # 24 random bytes, urlsafe
    assert retrieval_actor._bind(cfg)[1] != token  # fresh for each run
    monkeypatch.setenv("TREEOPSD_RETRIEVER_TOKEN", "from-env")
    assert retrieval_actor._bind(cfg) == ("node", "from-env")
    configured = load_config(overrides=["env.retriever_token=from-config"])
    assert retrieval_actor._bind(configured) == ("node", "from-config")
