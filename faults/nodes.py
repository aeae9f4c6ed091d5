"""The node drill: `treeopsd train` on a fake multi-node Ray cluster on this machine, and whole nodes lost
mid-run (`treeopsd drill --nodes 3 --kill-node learner@4,store@9`, launch/cmd_drill.py).

The cluster is `ray.cluster_utils.Cluster` started by this process: a head with no CPUs (the GCS and the
training driver, which joins through RAY_ADDRESS and attaches to the head's raylet; nothing is scheduled
there and it is never killed) and N worker nodes, each declaring one pool (faults/node_plan.node_layout):
`train` (learner, backup), `store`, `sample`. A node's processes are its raylet and every process under it
(the raylet starts the node's agents and its worker processes, where the role actors run); the node of a
role is the one whose raylet has that role's actor process under it (faults/processes.py reads /proc).

Losing a node: every process of that node's tree is SIGKILLed at once (raylet first, so it starts nothing
new), then `Cluster.remove_node(..., allow_graceful=False)` reaps the raylet and drops it from the cluster's
books; after NODE_GONE_S none of those pids may still run (checked, and reported). REPLACE_DELAY_S later a
node with the same resources joins, as an autoscaler or an operator would bring one, so the role can come
back there: Ray restarts the store and the samplers, the supervisor the learner and the backup.

Committed trees: at each kill, the tree ids of every segment renamed into the store's segments/ by then
(the store's commit point: a returned put is on disk). At the end each of them must still be in the store.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from faults.audit import batches_handed_out
from faults.node_plan import NodeSpec
from faults.processes import alive, process_tree, role_processes

REPLACE_DELAY_S = 3.0  # a lost node's replacement joins this long after the loss
NODE_GONE_S = 10.0  # how long the killed node's processes may take to be reaped before they count as alive
OBJECT_STORE_BYTES = 80 * 1024 * 1024  # each fake node's object store (Ray's minimum is 75 MiB)


def committed_tree_ids(store_dir: Path, cache: dict[str, list[str]] | None = None) -> set[str]:
    """The ids of every tree in a committed segment of the store now (segments are immutable once renamed,
    so `cache` keeps each file's ids). Read while the store writes: a segment quarantined meanwhile is
    skipped."""
    from storage import store_files as sf

    cache = {} if cache is None else cache
    segdir = store_dir / "segments"
    names = sorted(os.listdir(segdir)) if segdir.is_dir() else []
    for name in names:
        m = sf.SEGMENT_RE.match(name)
        if m is None or name in cache:
            continue
        try:
            cache[name] = [e[0] for e in sf.check_segment(segdir / name, int(m[1]), m[2], full=False)]
        except (*sf.BAD_SEGMENT, sf.StoreError, OSError):
            continue
    return {t for name in names for t in cache.get(name, [])}


def held_tree_ids(store_dir: Path) -> set[str]:
    """Every tree the store holds at the end (a read-only open: what a restarted store would serve)."""
    from storage.replay_store import ReplayStore

    with ReplayStore(store_dir, create=False, readonly=True) as store:
        return set(store.tree_ids())


@dataclass
class NodeKill:
    at: Any
    role: str
    node_id: str
    pool: str
    pids: list[int]  # every process of the node, SIGKILLed
    survivors: list[int] = field(default_factory=list)  # those still running NODE_GONE_S later
    committed_trees: int = 0  # trees committed to the store when the node went
    handed_out: int = 0  # batches the store had handed out then (below the run's steps: a kill mid-run)


class FakeCluster:
    """A head and worker nodes of `layout` on this machine (module docstring); `kill_role_node` is a
    campaign's kill function, `tick` its poll hook (adds due replacement nodes)."""

    def __init__(self, layout: list[NodeSpec], store_dir: Path) -> None:
        from ray.cluster_utils import Cluster

        self.store_dir = store_dir
        self._segments: dict[str, list[str]] = {}  # committed_tree_ids' cache
        head = {"num_cpus": 0, "include_dashboard": False, "object_store_memory": OBJECT_STORE_BYTES}
        self.cluster = Cluster(initialize_head=True, head_node_args=head)
        self.nodes: dict[Any, NodeSpec] = {}
        for spec in layout:
            self._add(spec)
        self.pending: list[tuple[float, NodeSpec]] = []  # (when, spec) of replacements to add
        self.kills: list[NodeKill] = []
        self.committed_at_kills: list[set[str]] = []
        self.on_head: set[str] = set()  # roles found on the head when their node was to be killed

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def _add(self, spec: NodeSpec) -> None:
        node = self.cluster.add_node(
            num_cpus=spec.num_cpus,
            resources={f"pool_{spec.pool}": 1.0},
            object_store_memory=OBJECT_STORE_BYTES,
        )
        self.nodes[node] = spec

    def node_of(self, role: str) -> Any | None:
        """The worker node whose raylet has a process of `role` under it now, or None."""
        for node in self.nodes:
            if role_processes(node.all_processes["raylet"][0].process.pid)[role]:
                return node
        return None

    def kill_role_node(self, role: str, rng: Any, child_pid: int) -> int | None:
        """Kills the whole node hosting `role` (module docstring); the raylet's pid, or None when no node
        hosts the role now (it is down: the campaign tries again at its next poll)."""
        node = self.node_of(role)
        if node is None:
            if role_processes(self.cluster.head_node.all_processes["raylet"][0].process.pid)[role]:
                self.on_head.add(role)  # never killed there: the plan cannot go on (reported)
            return None
        committed = committed_tree_ids(self.store_dir, self._segments)
        raylet = node.all_processes["raylet"][0].process.pid
        pids = process_tree(raylet)
        for pid in pids:  # the raylet first: it starts nothing new once it is gone
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        spec = self.nodes.pop(node)
        self.cluster.remove_node(node, allow_graceful=False)
        deadline = time.monotonic() + NODE_GONE_S
        while alive(pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        handed_out = batches_handed_out(self.store_dir)
        kill = NodeKill(None, role, node.node_id, spec.pool, pids, alive(pids), len(committed), handed_out)
        self.kills.append(kill)
        self.committed_at_kills.append(committed)
        self.pending.append((time.monotonic() + REPLACE_DELAY_S, spec))
        return raylet

    def tick(self) -> None:
        """Adds the replacement nodes that are due."""
        now = time.monotonic()
        for due in [p for p in self.pending if p[0] <= now]:
            self.pending.remove(due)
            self._add(due[1])

    def shutdown(self) -> None:
        self.cluster.shutdown()


def run_node_drill(
    run_dir: Path,
    steps: int,
    plan: list[tuple[int, str]],
    layout: list[NodeSpec],
    train: list[str],
    seed: int,
    timeout_s: float,
) -> dict[str, Any]:
    """Starts the fake cluster, runs `train` (train_command's child, its pools set) on it with the node
    kills of `plan` (campaign.AtSteps), audits, shuts the cluster down; the report (node_verdict's checks
    first, then the campaign audit's)."""
    from faults.audit import audit_run
    from faults.campaign import AtSteps, run_campaign
    from faults.node_plan import node_verdict, trees_lost

    t0 = time.monotonic()
    cluster = FakeCluster(layout, run_dir / "store")
    started_s = round(time.monotonic() - t0, 1)
    try:
        got = run_campaign(
            train,
            run_dir,
            AtSteps(plan, seed),
            timeout_s,
            name="node drill",
            ray_address=cluster.address,
            kill=cluster.kill_role_node,
            on_poll=cluster.tick,
        )
    finally:
        cluster.shutdown()
    for kill, (at, _, _) in zip(cluster.kills, got.kills, strict=False):
        kill.at = at
    audit = audit_run(run_dir, steps, got.returncode, plan, got.kills)
    held = held_tree_ids(run_dir / "store") if (run_dir / "store").is_dir() else set()
    lost = trees_lost(cluster.committed_at_kills, held)
    kills = [vars(k) for k in cluster.kills]
    found = node_verdict(audit, plan, kills, lost, got.stderr_tail, steps)
    nodes = [{"pool": n.pool, "num_cpus": n.num_cpus} for n in layout]
    return {
        **found,
        "plan": plan,
        "node_kills": kills,
        "committed_trees_lost": lost,
        "roles_on_the_head": sorted(cluster.on_head),
        "nodes": nodes,
        "cluster_start_s": started_s,
        "wall_s": got.wall_s,
        "stderr_tail": got.stderr_tail[-5:],
        "audit": audit,
    }
