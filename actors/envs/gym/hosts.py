"""Where an outside environment's instances live: in this process, or in a worker process running another
Python (`env.python`: the environment's own virtual env, e.g. one where verifiers has its `openai<3`).

    host = make_host("skyrl_gym:make", {"id": "gsm8k"}, python=None)            # in-process
    host = make_host("kb.taskset:KBTaskset", {}, python=".venv/ecosystems/bin/python")   # a worker
    handle, prompt = host.open({"task_id": "q1", "messages": [...], "record": {...}})
    host.step(handle, {"text": "...", "call": None, "error": None}); host.close_instance(handle)

The worker (actors/envs/gym/worker.py) speaks JSON lines over its stdin/stdout, one request at a time; no
pickle crosses the pipe. It is started on first use and stopped by `close`; a worker that dies or does not
answer within `timeout_s` is killed, the call fails (one line), and the next `open` starts a new one.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from actors.envs.gym.factory import FactoryError, load_backend

REPO = Path(__file__).resolve().parents[3]


class HostError(RuntimeError):
    """A call into the environment failed; the message is one line (the environment's own error)."""


class InProcessHost:
    def __init__(
        self, spec: str, args: Mapping[str, Any], ecosystem: str, options: Mapping[str, Any]
    ) -> None:
        self.backend = load_backend(spec, dict(args), ecosystem, options)
        self.ecosystem: str = self.backend.ecosystem

    def tasks(self) -> list[dict[str, Any]] | None:
        result: list[dict[str, Any]] | None = self.backend.tasks()
        return result

    def tools(self) -> list[dict[str, Any]]:
        return list(self.backend.tools())

    def open(self, task: Mapping[str, Any]) -> tuple[Any, list[dict[str, Any]]]:
        inst = self.backend.open(task)
        return inst, list(inst.prompt)

    def step(self, handle: Any, action: Mapping[str, Any]) -> dict[str, Any]:
        return dict(handle.step(action))

    def finish(self, handle: Any) -> float | None:
        value: float | None = handle.finish()
        return value

    def close_instance(self, handle: Any) -> None:
        handle.close()

    def close(self) -> None:
        return None


class SubprocessHost:
    def __init__(
        self,
        python: str,
        spec: str,
        args: Mapping[str, Any],
        ecosystem: str,
        options: Mapping[str, Any],
        timeout_s: float = 300.0,
    ) -> None:
        self.python, self.timeout_s = python, timeout_s
        self.load = {
            "op": "load",
            "spec": spec,
            "args": dict(args),
            "ecosystem": ecosystem,
            "options": dict(options),
        }
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self.generation = 0
        self.ecosystem = str(self._call(self.load, start=True))  # the factory imports there, or one line

    def _start(self) -> subprocess.Popen[bytes]:
        if not Path(self.python).exists():
            raise FactoryError(f"env.python = {self.python!r}: no such interpreter")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        cmd = [self.python, "-m", "actors.envs.gym.worker"]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.generation += 1
        return proc

    def _call(self, request: Mapping[str, Any], start: bool = False) -> Any:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                if not start:
                    code = "" if self._proc is None else f", exit code {self._proc.returncode}"
                    self._proc = None
                    raise HostError(
                        f"the environment worker ({self.python}) died{code} before {request['op']}"
                    )
                self._proc = self._start()
                if request is not self.load:
                    self._exchange(self.load)
            return self._exchange(request)

    def _exchange(self, request: Mapping[str, Any]) -> Any:
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(json.dumps(request).encode() + b"\n")
            proc.stdin.flush()
            ready, _, _ = select.select([proc.stdout], [], [], self.timeout_s)
            line = proc.stdout.readline() if ready else b""
        except (BrokenPipeError, OSError):
            line = b""
        if not line:
            self._kill()
            why = f"did not answer within {self.timeout_s:.0f} s" if proc.poll() is None else "died"
            raise HostError(f"the environment worker ({self.python}) {why} during {request['op']}")
        reply = json.loads(line)
        if not reply.get("ok"):
            cls = FactoryError if reply.get("factory") else HostError
            raise cls(str(reply.get("error")))
        return reply.get("result")

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def tasks(self) -> list[dict[str, Any]] | None:
        result: list[dict[str, Any]] | None = self._call({"op": "tasks"}, start=True)
        return result

    def tools(self) -> list[dict[str, Any]]:
        return list(self._call({"op": "tools"}, start=True))

    def open(self, task: Mapping[str, Any]) -> tuple[Any, list[dict[str, Any]]]:
        result = self._call({"op": "open", "task": dict(task)}, start=True)
        return (self.generation, int(result["id"])), list(result["prompt"])

    def _on(self, handle: Any, request: dict[str, Any]) -> Any:
        generation, ident = handle
        if generation != self.generation:
            raise HostError("the environment worker was restarted; this instance is gone")
        return self._call({**request, "id": ident})

    def step(self, handle: Any, action: Mapping[str, Any]) -> dict[str, Any]:
        return dict(self._on(handle, {"op": "step", "action": dict(action)}))

    def finish(self, handle: Any) -> float | None:
        value = self._on(handle, {"op": "finish"})
        return None if value is None else float(value)

    def close_instance(self, handle: Any) -> None:
        if handle[0] == self.generation and self._proc is not None:
            self._on(handle, {"op": "close"})

    def close(self) -> None:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                assert self._proc.stdin is not None
                try:
                    self._proc.stdin.close()  # the worker ends at EOF
                    self._proc.wait(timeout=10)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            self._kill()


def make_host(
    spec: str,
    args: Mapping[str, Any],
    python: str | None = None,
    ecosystem: str = "auto",
    options: Mapping[str, Any] | None = None,
    timeout_s: float = 300.0,
) -> InProcessHost | SubprocessHost:
    if python is None:
        return InProcessHost(spec, args, ecosystem, options or {})
    return SubprocessHost(python, spec, args, ecosystem, options or {}, timeout_s)
