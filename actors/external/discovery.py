"""Where an agent in its own process finds the run's endpoints, one per sampler: RUN_DIR/agent_endpoints.json.

    entry = Discovery(run_dir, index)      # sampler `index`
    entry.publish("http://127.0.0.1:8101/v1")   # when its endpoint is bound (a restarted sampler: again)
    entry.withdraw()                       # when it closes
    read_endpoints(run_dir / ENDPOINTS_FILE)   # [{"sampler": 0, "base_url": ...}, ...]: what an agent reads

The file is JSON, `{"endpoints": [{"sampler": i, "base_url": "http://HOST:PORT/v1"}, ...]}` by sampler
index, rewritten whole on every change (temp file, fsync, rename: a reader sees the old list or the new one,
never part of one); the samplers of a run share it under an flock on `agent_endpoints.json.lock`. It holds
no secret: with `env.agent_token` set the agent takes the token from its own environment
(`$TREEOPSD_AGENT_TOKEN`). A sampler killed without closing (a crash, a retired one) leaves its entry until
its restart rewrites it; an agent treats an endpoint that does not answer as one with no task.

Ports (`env.agent_port`): 0 gives each sampler a free port; a fixed port P gives sampler i the port P + i
(i: its index in the run, `RUN_DIR/logs/sampler-<i>.log`; samplers added by `treeopsd scale` or a restart
of the pool continue the count). `check_ports` checks at config load that P .. P + N − 1 are free.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
from pathlib import Path
from typing import Any

from storage.durable import write_atomic

ENDPOINTS_FILE = "agent_endpoints.json"


def sampler_port(agent_port: int, index: int) -> int:
    """The port sampler `index` binds: 0 (a free one) stays 0, a fixed port P is P + index."""
    return agent_port + index if agent_port else 0


def check_ports(host: str, agent_port: int, num_samplers: int) -> None:
    """Raises ValueError, one line naming env.agent_port, when a port of P .. P + N − 1 cannot be bound."""
    if not agent_port:
        return
    last = agent_port + num_samplers - 1
    span = (
        f"{agent_port}" if num_samplers == 1 else f"{agent_port}..{last} (sampler i binds {agent_port} + i)"
    )
    for port in range(agent_port, last + 1):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host.strip("[]"), port))
            except OSError as exc:
                why = f"port {port} on {host} is not free ({exc.strerror or exc})"
                raise ValueError(
                    f"env.agent_port = {agent_port}: {why}; the run's {num_samplers} sampler(s) need {span}"
                ) from None


def read_endpoints(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The endpoints listed in a discovery file ([] when it is missing or unreadable)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return []
    entries = data.get("endpoints") if isinstance(data, dict) else None
    return [e for e in entries or [] if isinstance(e, dict) and isinstance(e.get("base_url"), str)]


def reachable_url(url: str, host: str) -> str:
    """`url` with an unspecified bind address (0.0.0.0, ::) replaced by this machine's name."""
    bare = host.strip("[]")
    if bare not in ("0.0.0.0", "::"):
        return url
    shown = f"[{bare}]" if ":" in bare else bare
    return url.replace(f"//{shown}:", f"//{socket.gethostname()}:", 1)


class Discovery:
    """Sampler `index`'s entry in `<run_dir>/agent_endpoints.json`."""

    def __init__(self, run_dir: str | os.PathLike[str], index: int) -> None:
        self.path, self.index = Path(run_dir) / ENDPOINTS_FILE, index

    def publish(self, base_url: str) -> None:
        self._update({"sampler": self.index, "base_url": base_url})

    def withdraw(self) -> None:
        with contextlib.suppress(OSError):
            self._update(None)

    def _update(self, entry: dict[str, Any] | None) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the run's samplers rewrite one file: one at a time
            others = [e for e in read_endpoints(self.path) if e.get("sampler") != self.index]
            entries = sorted([*others, *([entry] if entry else [])], key=lambda e: int(e.get("sampler", 0)))
            write_atomic(self.path, json.dumps({"endpoints": entries}, indent=1).encode(), unique=True)
        finally:
            os.close(lock)  # releases the flock
