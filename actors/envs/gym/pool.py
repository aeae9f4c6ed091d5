"""The live instances of an outside environment and the observations they gave, both keyed by where they
stand: (task id, hash of the actions so far).

    key = history_key(task.task_id, ["<think>…</think> 42", "#### 42"])    # the state after two actions
    pool.put(key, instance)        # a live instance standing exactly there (at most `size`; LRU closed)
    inst = pool.take(key)          # taken out: one episode steps it at a time; None on a miss
    cache.put(key, outcome)        # what the step into `key` returned (observation, reward, done)

A rollout tree asks for the same prefixes again and again: its M trajectories start from the same reset,
each branch starts from a prefix one trajectory already walked. The cache answers a step whose key it holds
without an instance; a miss takes the instance standing at the parent key or, failing that, builds one and
replays the prefix (actors/envs/gym/adapter.py). Both are bounded; the pool closes what it evicts.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

V = TypeVar("V")
Key = tuple[str, str]


def history_key(task_id: str, actions: Sequence[str]) -> Key:
    """(task id, sha256 over the actions, each length-prefixed so no two histories share a hash)."""
    h = hashlib.sha256()
    for a in actions:
        data = a.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return task_id, h.hexdigest()


@dataclass(frozen=True)
class Outcome:
    """One step of an outside environment, as the adapter stores and compares it. `ret` is the return so
    far on this path (the sum of the step rewards, the reset's included), the reward a leaf gets."""

    observation: str
    messages: tuple[dict[str, Any], ...]
    reward: float
    done: bool
    ret: float
    info: dict[str, Any] = field(default_factory=dict, compare=False)

    def same_as(self, other: Outcome) -> bool:
        """What a replay must reproduce: the observation (text and messages), the reward, the end."""
        return (self.observation, self.messages, self.reward, self.done) == (
            other.observation,
            other.messages,
            other.reward,
            other.done,
        )


class LRU(Generic[V]):
    """A bounded, thread-safe mapping; `on_evict` gets each value pushed out by a newer one."""

    def __init__(self, size: int, on_evict: Callable[[V], None] | None = None) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size, self.on_evict = size, on_evict
        self._items: OrderedDict[Key, V] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: Key) -> V | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def take(self, key: Key) -> V | None:
        with self._lock:
            return self._items.pop(key, None)

    def put(self, key: Key, value: V) -> None:
        evicted: list[V] = []
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None and old is not value:
                evicted.append(old)  # two instances at one key: keep the newer
            self._items[key] = value
            while len(self._items) > self.size:
                evicted.append(self._items.popitem(last=False)[1])
        for v in evicted:  # outside the lock: closing an instance may take a while
            if self.on_evict is not None:
                self.on_evict(v)

    def take_tasks(self, task_ids: Iterable[str]) -> list[V]:
        """Removes and returns every value of these tasks (their trees are stored)."""
        wanted = set(task_ids)
        with self._lock:
            keys = [k for k in self._items if k[0] in wanted]
            return [self._items.pop(k) for k in keys]

    def take_all(self) -> list[V]:
        with self._lock:
            values = list(self._items.values())
            self._items.clear()
            return values
