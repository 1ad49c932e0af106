"""deploy/nginx/shared.conf with the real nginx in front of two real nodes sharing a real
PostgreSQL (docs/scaling.md §Shared storage): a user's node dies (``kill -9``), and the ring
sends the user's next requests to the other node, which serves them with every acknowledged
turn — an ``Idempotency-Key`` retry of the acknowledged request is replayed, not run again."""
from __future__ import annotations

import os
import signal

import pytest
import requests

from support.fixtures import API_KEY, ServiceProcess, base_config, deep_merge
from support.nginx_harness import DEPLOY, Nginx, free_port, render, require_nginx
from support.postgres import PASSWORD_ENV

pytestmark = pytest.mark.e2e


def test_a_dead_nodes_users_reach_the_next_node_through_nginx(tmp_path, model, postgres):
    require_nginx()
    url = postgres.url(postgres.create_database())
    nodes: dict[str, ServiceProcess] = {}
    nginx = None
    try:
        for name in ("n1", "n2"):
            cfg = deep_merge(base_config(tmp_path / name, model.base_url), {
                "nginx": {"enable_real_ip": True, "trusted_proxies": ["127.0.0.1"]},
                "service": {"node_id": name},
                "storage": {"url": url, "password_env": PASSWORD_ENV, "node_id": name,
                            "lease_ttl_seconds": 3}})
            (tmp_path / name).mkdir()
            nodes[name] = ServiceProcess(tmp_path / name, cfg).start()
        port = free_port()
        site = render(DEPLOY / "nginx" / "shared.conf", {
            "server 127.0.0.1:9201": f"server 127.0.0.1:{nodes['n1'].port}",
            "server 127.0.0.1:9202": f"server 127.0.0.1:{nodes['n2'].port}",
            "listen 80;": f"listen 127.0.0.1:{port};",
            "/var/log/nginx/": f"{tmp_path}/nginx/logs/"})
        nginx = Nginx(tmp_path / "nginx", site).start(port)
        user = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": "nina"}

        def call(method, path, **kw):
            return requests.request(method, nginx.url + path, headers={**user, **kw.pop(
                "headers", {})}, timeout=180, **kw)

        sid = call("POST", "/api/v1/sessions", json={"user_id": "nina"}).json()["session_id"]
        key = {"Idempotency-Key": "ng-k1"}
        first = call("POST", f"/api/v1/sessions/{sid}/messages",
                     json={"message": "ng-m1 hi"}, headers=key)
        assert first.status_code == 200, first.text
        [(holder,)] = postgres.admin_sql(
            "SELECT holder FROM leases WHERE user_id = 'nina'", dbname=url.rsplit("/", 1)[1])
        dead = nodes[holder]
        os.killpg(dead.proc.pid, signal.SIGKILL)
        dead.proc.wait(10)

        listed = call("GET", "/api/v1/sessions?user_id=nina")   # nginx retries the GET
        assert listed.status_code == 200, listed.text
        assert [s["local_session_id"] for s in listed.json()["sessions"]] == [sid]
        again = call("POST", f"/api/v1/sessions/{sid}/messages",
                     json={"message": "ng-m1 hi"}, headers=key)
        assert again.status_code == 200 and again.headers.get("Idempotency-Replayed") == "true"
        assert len(model.requests_with("ng-m1")) == 1
        nxt = call("POST", f"/api/v1/sessions/{sid}/messages", json={"message": "[[recall]]"})
        assert nxt.status_code == 200 and nxt.json()["response"].endswith("ng-m1 hi")
    finally:
        if nginx is not None:
            nginx.stop()
        for svc in nodes.values():
            svc.stop()
