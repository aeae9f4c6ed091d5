"""The environment worker: `python -m actors.envs.gym.worker`, run by actors/envs/gym/hosts.py in the
environment's own Python (`env.python`). One JSON request per line on stdin, one JSON reply per line:

    {"op": "load", "spec": "kb.taskset:KBTaskset", "args": {}, "ecosystem": "auto", "options": {}}
    {"op": "tasks"} | {"op": "tools"} | {"op": "open", "task": {...}}      -> {"ok": true, "result": ...}
    {"op": "step", "id": 3, "action": {...}} | {"op": "finish", "id": 3} | {"op": "close", "id": 3}
    a failure: {"ok": false, "error": "ValueError: ...", "factory": false}

The protocol keeps the process's real stdout to itself: whatever the environment prints goes to stderr.
It exits at end of input. Stdlib only, besides the environment's own packages.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from actors.envs.gym.factory import FactoryError, load_backend, one_line


class Worker:
    def __init__(self) -> None:
        self.backend: Any = None
        self.instances: dict[int, Any] = {}
        self.next_id = 0

    def handle(self, req: dict[str, Any]) -> Any:
        op = req.get("op")
        if op == "load":
            self.backend = load_backend(
                req["spec"], req.get("args") or {}, req.get("ecosystem", "auto"), req.get("options")
            )
            return self.backend.ecosystem
        if op == "tasks":
            return self.backend.tasks()
        if op == "tools":
            return self.backend.tools()
        if op == "open":
            inst = self.backend.open(req["task"])
            self.next_id += 1
            self.instances[self.next_id] = inst
            return {"id": self.next_id, "prompt": inst.prompt}
        inst = self.instances[int(req["id"])]
        if op == "step":
            return inst.step(req["action"])
        if op == "finish":
            return inst.finish()
        if op == "close":
            del self.instances[int(req["id"])]
            inst.close()
            return None
        raise ValueError(f"unknown op {op!r}")


def main() -> int:
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")  # the protocol's channel
    os.dup2(2, 1)  # the environment's prints go to stderr
    sys.stdout = sys.stderr
    worker = Worker()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply = {"ok": True, "result": worker.handle(json.loads(line))}
        except FactoryError as exc:
            reply = {"ok": False, "error": str(exc), "factory": True}
        except Exception as exc:  # the environment's failure: the adapter names it with the task
            reply = {"ok": False, "error": one_line(exc), "factory": False}
        out.write(json.dumps(reply, default=str) + "\n")
        out.flush()
    for inst in worker.instances.values():
        try:
            inst.close()
        except Exception as exc:
            print(f"closing an instance at exit raised {one_line(exc)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
