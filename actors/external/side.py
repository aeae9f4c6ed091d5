"""Side calls: the requests of a session that do not continue its main conversation, as linked segments.

    seg = route(s, req)          # None: the main conversation (the tree), else the side segment it goes to
    extend(rnd, s, seg, req)     # its context ids (a new segment: the prompt's; else the observation's)

Every chat-completions call of a session is recorded (`Session.calls`) with its segment (0: the main
conversation; i ≥ 1: `Session.sides[i - 1]`) and its parent, the call whose conversation it extends (None:
the first call of a segment). Which segment a request goes to:

  * it extends the main conversation's messages with the same tools: the main conversation (the tree; the
    replay and mismatch rules of session.py apply, a branch is checked against its anchor);
  * it extends a side segment's recorded conversation (its tools too): that segment's next turn;
  * it has no assistant message (a summariser, a judge, a sub-agent; or a compaction: the history replaced
    by a summary), or it extends the main conversation's messages with other tools (a summariser given the
    history with no tools): a new side segment, linked to the session's last call (`after`) and to the
    number of main turns at its start (`main_turns`);
  * else (an assistant message that is no recorded one: an edited history): the main conversation, whose
    409 it gets (session.py).

A segment's turns are sampled from its exact context, as the main conversation's (the prompt's ids, then
per turn the sampled ids and the observation's delta ids), with `env.max_turns`, `env.max_turn_tokens` and
`env.token_budget` per segment; a limit ends the segment only (400), never the episode. Side turns are never
replayed: a branch samples its own. What is stored of them is trees.py's (`env.side_calls`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from actors.external.openai_format import ApiError, ChatRequest, first_difference, normalize_message
from system.tree import RolloutTree
from system.tree_build import TreeBuilder

# session.py's Round, Session and Turn: it imports this module, so they are `Any` here
Round = Session = Turn = Any


@dataclass(frozen=True)
class Call:
    segment: int  # 0: the main conversation; i >= 1: Session.sides[i - 1]
    parent: int | None  # the call (index into Session.calls) whose conversation this one extends


@dataclass
class Segment:
    index: int  # >= 1
    key: str  # the backend's cache key: "<session>/s<index>"
    messages: list[dict[str, Any]]  # its prompt
    tools: list[dict[str, Any]]
    after: int | None  # the session's last call before its first one (None: it came first)
    main_turns: int  # main turns at its start
    ids: list[int] = field(default_factory=list)  # the prompt's ids
    turns: list[Turn] = field(default_factory=list)
    context: list[int] = field(default_factory=list)
    finish: str | None = None  # ended by a limit: truncated, max_turns, token_budget
    last_call: int | None = None

    def recorded(self) -> list[dict[str, Any]]:
        out = list(self.messages)
        for t in self.turns:
            out += [normalize_message(t.message, "recorded"), *t.obs_messages]
        return out


def _extends(req: ChatRequest, recorded: list[dict[str, Any]]) -> bool:
    return len(req.messages) > len(recorded) and first_difference(req.messages, recorded) is None


def route(s: Session, req: ChatRequest) -> Segment | None:
    """The side segment `req` goes to (a new one, not yet added), or None: the main conversation."""
    assert s.tree.prompt is not None
    main = s.recorded()
    on_main = first_difference(req.messages, main) is None
    if on_main and req.tools == s.tree.prompt.tools:
        return None
    for seg in reversed(s.sides):
        if req.tools == seg.tools and _extends(req, seg.recorded()):
            return seg
    if on_main or not any(m["role"] == "assistant" for m in req.messages):
        after = len(s.calls) - 1 if s.calls else None
        key = f"{s.key}/s{len(s.sides) + 1}"
        return Segment(len(s.sides) + 1, key, req.messages, req.tools, after, len(s.turns))
    return None


def extend(rnd: Round, s: Session, seg: Segment, req: ChatRequest) -> None:
    """The segment's context for its next turn: a new segment's prompt ids (it joins the session), or the
    observation's delta ids; a limit ends the segment (ApiError 400)."""
    limits = rnd.limits
    if seg.finish is not None:
        why = f"side segment {seg.key!r} ended ({seg.finish}): start a new one"
        raise ApiError(400, why, "session_ended")
    if not seg.turns:
        seg.ids = rnd.templates.prompt_ids(req.messages, req.tools)
        if len(seg.ids) >= limits.token_budget:
            why = f"the side call's prompt is {len(seg.ids)} tokens: env.token_budget ({limits.token_budget})"
            raise ApiError(400, f"{why} leaves no room for a turn", "context_length_exceeded", "messages")
        seg.context = list(seg.ids)
        s.sides.append(seg)
        return
    new = req.messages[len(seg.recorded()) :]
    if any(m["role"] == "assistant" for m in new):
        raise ApiError(400, f"side segment {seg.key!r}: add tool or user messages only", param="messages")
    last = seg.turns[-1]
    delta = rnd.templates.delta_ids(new, last.ids)
    if len(seg.turns) >= limits.max_turns:
        seg.finish = "max_turns"
    elif len(seg.context) + len(delta) >= limits.token_budget:
        seg.finish = "token_budget"
    if seg.finish is not None:
        raise ApiError(400, f"side segment {seg.key!r} reached env.{seg.finish}: it is over", seg.finish)
    last.obs_messages, last.obs_ids = new, delta
    seg.context = [*seg.context, *delta]


def record_call(s: Session, segment: int, parent: int | None) -> int:
    """Appends the call to the session's log; its index."""
    s.calls.append(Call(segment, parent))
    return len(s.calls) - 1


def calls_meta(sessions: list[Session]) -> str:
    """The stored sessions' call logs as JSON: {session: [[segment, parent call], ...]}."""
    return json.dumps({s.key: [[c.segment, c.parent] for c in s.calls] for s in sessions})


def side_trees(
    tree_id: str, meta: dict[str, str], sessions: list[Session], mask_truncated: bool
) -> list[RolloutTree]:
    """The side segments of a tree's stored episodes as trees of their own, linked to the episode's tree:
    `prompt_id` the task's, meta `episode_tree` its id and `links` per leaf (session, segment, after_call,
    main_turns). Segments with the same prompt ids share one tree (its leaves a group: their rewards
    compared), one leaf per session at most (so K ≤ the episode tree's); each leaf's reward is its
    episode's (0 for a segment a limit ended)."""
    groups: dict[tuple[Any, ...], tuple[TreeBuilder, list[dict[str, Any]], dict[str, str]]] = {}
    for s in sessions:
        assert s.reward is not None
        nth: dict[tuple[int, ...], int] = {}  # its n-th segment with a prompt: one leaf per tree
        for seg in (seg for seg in s.sides if seg.turns):
            nth[tuple(seg.ids)] = n = nth.get(tuple(seg.ids), -1) + 1
            key = (n, *seg.ids)
            if key not in groups:
                side_id = f"{tree_id}/side{len(groups)}"
                b = TreeBuilder(side_id, seg.ids, prompt_id=meta.get("task_id", ""), meta=dict(meta))
                groups[key] = (b, [], {})
            b, links, finish = groups[key]
            node = 0
            for t in seg.turns:
                cut = t.finish_reason != "stop" and mask_truncated
                node = b.add_turn(node, t.ids, t.logprobs, t.obs_ids, [not cut] * len(t.ids), t.version)
            b.set_reward(node, 0.0 if seg.finish is not None else s.reward)
            finish[str(node)] = seg.finish or "done"
            link = {"session": s.key, "segment": seg.index, "after_call": seg.after, "leaf": node}
            links.append({**link, "main_turns": seg.main_turns})
    out = []
    for b, links, finish in groups.values():
        b.meta.update(source="external-side", episode_tree=tree_id, links=json.dumps(links))
        b.meta["finish"] = json.dumps(finish)
        out.append(b.build())
    return out
