"""The plan of a node drill (`treeopsd drill --nodes N --kill-node SPEC`, faults/nodes.py): which nodes the
fake cluster has, which pool each serves, the config overrides that put the roles on them, and which role's
node dies at which step. Pure: nothing here starts or kills anything.

    parse_kill_nodes("learner@4,store@9", steps=16)   # [(4, "learner"), (9, "store")]
    node_layout(3)       # train (learner, backup), store, sample: one pool each, the head holds none
    pool_overrides()     # resources.<role>.pool=... for `treeopsd train`

A kill names a role, not a node: the node is the one that hosts the role at that moment (a role restarted
after an earlier kill may have moved to the replacement node).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

NODE_ROLES = ("sampler", "learner", "store")  # each on a node of its own pool
ROLE_POOL = {"sampler": "sample", "learner": "train", "store": "store"}
BACKUP_POOL = "train"  # the backup is light CPU work next to the learner (configs/cluster_example.yaml)
KILL_NODE_HELP = (
    "comma-separated ROLE@STEP: kill the whole node hosting ROLE (sampler, learner or store; "
    "'sampler-node' and the like also work) once STEP batches are handed out, e.g. learner@4,store@9 "
    "or sampler-node@3,learner@8; steps strictly increasing, each below --steps"
)


@dataclass(frozen=True)
class NodeSpec:
    pool: str  # the node declares custom resource pool_<pool>
    num_cpus: int  # logical CPUs Ray may hand out there (the roles mostly wait on each other)


def parse_kill_nodes(spec: str, steps: int) -> list[tuple[int, str]]:
    """[(step, role), ...] from "ROLE@STEP,..." (KILL_NODE_HELP); ValueError naming the bad part."""
    plan: list[tuple[int, str]] = []
    for part in (p.strip() for p in spec.split(",")):
        role, sep, at = part.partition("@")
        role = role.strip().removesuffix("-node")
        if not sep or role not in NODE_ROLES:
            raise ValueError(f"{part!r}: expected ROLE@STEP with ROLE one of {', '.join(NODE_ROLES)}")
        try:
            step = int(at)
        except ValueError:
            raise ValueError(f"{part!r}: the step {at!r} is not an integer") from None
        if not 1 <= step < steps:
            raise ValueError(f"{part!r}: the step must be in 1..{steps - 1} (the run has {steps} steps)")
        if plan and step <= plan[-1][0]:
            raise ValueError(f"{part!r}: steps must strictly increase (after step {plan[-1][0]})")
        plan.append((step, role))
    return plan


def node_layout(nodes: int, sampler_cpus: int = 4) -> list[NodeSpec]:
    """The worker nodes (besides a head with no CPUs, which only hosts Ray's control plane and the driver):
    a train node, a store node, and the rest sampler nodes; at least 3, so the three roles never share."""
    if nodes < 3:
        raise ValueError(f"a node drill needs at least 3 nodes (sampler, learner, store), got {nodes}")
    return [NodeSpec("train", 2), NodeSpec("store", 1), *[NodeSpec("sample", sampler_cpus)] * (nodes - 2)]


def pool_overrides() -> list[str]:
    """`treeopsd train` overrides that pin every role to its pool."""
    pools = {**ROLE_POOL, "backup": BACKUP_POOL}
    return [f"resources.{role}.pool={pool}" for role, pool in pools.items()]


def trees_lost(committed_at_kills: Sequence[set[str]], held: set[str]) -> list[str]:
    """The trees committed before some kill (renamed into segments/: durable by the store's contract) that
    the store no longer holds at the end, sorted."""
    before = set().union(*committed_at_kills) if committed_at_kills else set()
    return sorted(before - held)


def stopped_with_one_line(returncode: int, stderr_tail: Sequence[str]) -> bool:
    """The run stopped by itself with its one-line reason (`treeopsd train: ...`), not a traceback."""
    said = any(line.startswith("treeopsd train: ") for line in stderr_tail)
    return returncode != 0 and said and not any(line.startswith("Traceback") for line in stderr_tail)


def node_verdict(
    audit: Mapping[str, Any],
    plan: Sequence[tuple[int, str]],
    kills: Sequence[Mapping[str, Any]],
    lost: Sequence[str],
    stderr_tail: Sequence[str],
    steps: int,
) -> dict[str, Any]:
    """The node drill's checks over the campaign audit (faults/audit.audit_run) and the node kills: the
    run healed (every audit check) or stopped with one line; either way no batch trained twice, no tree
    in two batches, the store verifies, no tree lost, duplicated or half-visible, no committed tree lost,
    and every planned node died whole (no process of it left) while the run still had batches to hand out
    (a kill after the last one tests nothing of training)."""
    checks = dict(audit["checks"])
    healed = all(checks.values())
    stopped = stopped_with_one_line(int(audit["returncode"]), stderr_tail)
    data = ("no_tree_in_two_batches", "store_verify_clean", "no_tree_lost_duplicated_or_half_visible")
    node_checks = {
        "healed_or_one_line_stop": healed or stopped,
        "no_batch_trained_twice": not audit["batches_trained_twice"],
        **{name: bool(checks.get(name, False)) for name in data},
        "no_committed_tree_lost": not lost,
        "planned_nodes_killed": [(k["at"], k["role"]) for k in kills] == [tuple(p) for p in plan],
        "no_process_of_a_killed_node_survives": all(not k["survivors"] for k in kills),
        "every_kill_before_the_last_batch": all(k["handed_out"] < steps for k in kills),
    }
    return {
        "ok": all(node_checks.values()),
        "outcome": "healed" if healed else "stopped" if stopped else "failed",
        "node_checks": node_checks,
    }
