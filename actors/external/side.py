"""Which conversation a request goes to, and the side trees: the conversations outside an episode's line.

    kind, conv = route(s, req)   # ("extend", conv) | ("tool_change", conv) | ("new", None); a rewrite: 409
    trees, flat = side_trees(tree_id, meta, sessions, mask_truncated, keep="train")

Routing (every chat-completions call of a session, session.py):

  * it extends a conversation's recorded messages (the latest conversation first) with the same tools: that
    conversation's next turn;
  * it extends one with other tools: a *change of tools* — refused with a 409 (`env.tool_change=refuse`,
    the default: a harness that drops its tools for a final answer would otherwise end its episode's line
    unseen), or a new conversation continuing that one (`continue`: counted, `external/tool_changes`);
  * it has no assistant message (a summariser, a judge, a sub-agent, a compaction): a new conversation;
  * else (an assistant message that was never returned: an edited history): a 409 naming the difference.

What becomes of each conversation is line.py's: the episode's line (its tree) holds the conversations it
runs in (a compaction continues it) and those whose replies it was fed; the others are *side calls*, stored
here as trees of their own, linked to the episode tree: `<tree id>/side<j>`, meta `source: external-side`,
`episode_tree`, `links` (per leaf: session, conversation, first_call, leaf). Conversations with the same
prompt ids across a tree's episodes (the same judge) share one side tree, one leaf per session at most;
each leaf's reward is its episode's (0 for a conversation a limit ended). `env.side_calls`: `train` stores
the side trees that carry signal (two leaves or more whose rewards differ: a tree of one leaf, or of equal
rewards, has z = 0 everywhere), `all` every one, `exclude` none; those not stored are counted.
"""

from __future__ import annotations

import json
from typing import Any

from actors.external.openai_format import ApiError, ChatRequest, first_difference
from actors.external.session import Conversation, Session
from system.tree import RolloutTree
from system.tree_build import TreeBuilder


def route(s: Session, req: ChatRequest) -> tuple[str, Conversation | None]:
    """Where `req` goes (module docstring); a rewrite of a conversation is an ApiError 409."""
    changed = None  # the conversation it extends with other tools
    closest: tuple[int, str] | None = None  # (matched messages, why) of the best rewrite, for the 409
    for conv in reversed(s.convs):
        recorded = conv.recorded()
        why = first_difference(req.messages, recorded)
        if why is None and len(req.messages) > len(recorded):
            if req.tools == conv.tools:
                return "extend", conv
            changed = changed or conv
        elif why is not None:
            pairs = zip(req.messages, recorded, strict=False)
            same = next(
                (i for i, (a, b) in enumerate(pairs) if a != b), min(len(req.messages), len(recorded))
            )
            if closest is None or same > closest[0]:
                closest = (same, f"conversation {conv.index}: {why}")
        else:  # every message of the record and nothing after it
            closest = (len(recorded), f"conversation {conv.index}: no message after its last assistant turn")
    if changed is not None:
        return "tool_change", changed
    if not any(m["role"] == "assistant" for m in req.messages):
        return "new", None
    why = closest[1] if closest else "an assistant message this session never returned"
    raise ApiError(409, f"{why}: a request must extend its conversation as returned", "context_mismatch")


def conversation_tools_changed(conv: Conversation) -> ApiError:
    why = (
        f"tools differ from conversation {conv.index}'s: a change of tools would end it here "
        "(send the same tools, or set env.tool_change=continue to record it as a new context)"
    )
    return ApiError(409, why, "tool_change", "tools")


def calls_meta(sessions: list[Session]) -> str:
    """The stored sessions' call logs as JSON: {session: [[conversation, parent call], ...]}."""
    return json.dumps({s.key: [[c.conv, c.parent] for c in s.calls] for s in sessions})


def signal(tree: RolloutTree) -> bool:
    """Its leaves' rewards differ (then some z ≠ 0): a side tree worth training."""
    rewards = tree.leaf_rewards()
    return len(rewards) > 1 and bool(rewards.max() > rewards.min())


def side_trees(
    tree_id: str,
    meta: dict[str, str],
    sides: list[tuple[Session, Conversation]],
    mask_truncated: bool,
    keep: str,
) -> tuple[list[RolloutTree], int]:
    """(the side trees of a tree's stored episodes that `keep` stores, how many were not stored); `sides`:
    (session, conversation) of every side conversation, in session order (module docstring)."""
    groups: dict[tuple[Any, ...], tuple[TreeBuilder, list[dict[str, Any]], dict[str, str]]] = {}
    nth: dict[tuple[str, tuple[int, ...]], int] = {}  # a session's n-th conversation with a prompt
    for s, conv in sides:
        assert s.reward is not None
        n = nth[(s.key, tuple(conv.ids))] = nth.get((s.key, tuple(conv.ids)), -1) + 1
        key = (n, *conv.ids)
        if key not in groups:
            side_id = f"{tree_id}/side{len(groups)}"
            groups[key] = (TreeBuilder(side_id, conv.ids, meta.get("task_id", ""), dict(meta)), [], {})
        b, links, finish = groups[key]
        node = 0
        for t in conv.turns:
            cut = t.finish_reason != "stop" and mask_truncated
            node = b.add_turn(node, t.ids, t.logprobs, t.obs_ids, [not cut] * len(t.ids), t.version)
        b.set_reward(node, 0.0 if conv.finish is not None else s.reward)
        finish[str(node)] = conv.finish or "done"
        links.append(
            {"session": s.key, "conversation": conv.index, "first_call": conv.first_call, "leaf": node}
        )
    out = []
    for b, links, finish in groups.values():
        b.meta.update(source="external-side", episode_tree=tree_id, links=json.dumps(links))
        b.meta["finish"] = json.dumps(finish)
        out.append(b.build())
    kept = [t for t in out if keep == "all" or (keep == "train" and signal(t))]
    return kept, len(out) - len(kept)
