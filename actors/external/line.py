"""An episode's line: the calls its tree holds, decided once the episode is over, and their tree nodes.

    line = episode_line(s)                   # call indices, in order; sets s.finish (the line's limit)
    node = add_line(builder, s, calls, parent)   # the calls as a chain under `parent`, restarts included

An agent with a long context does not stay in one conversation. Its episode runs in a chain of *main*
conversations: conversation 0, then each one that continues the current one — opened after the current
one's last call (which is never extended again), with its tools and its system message (a compaction: the
history replaced by a summary), or opened by a change of its tools (`env.tool_change=continue`). A
conversation outside that chain *feeds* the line when a reply of it reappears in a later request of the
chain (a summary in the compacted prompt, a sub-agent's answer in a tool result): its calls are turns of the
episode too. The line is the calls of both, in call order; every other conversation is a side call
(side.py). So the turns after a compaction are anchors like any other, and the summary that made it is a
turn of the episode, with the episode's credit.

In the tree, each line call is a turn node under the one before it: its context extends the previous call's
(that call's ids, then the observation's delta ids, stored as that node's observation), or it does not (a
new conversation, a summary, a sub-agent, a return to the main conversation after one): then a *restart*
node carries the call's whole context (system/tree.py), and the turn hangs under it. The learner scores
every turn after exactly the ids it was sampled after.
"""

from __future__ import annotations

import re
from typing import Any

from actors.external.session import Conversation, Session, Turn
from system.tree_build import TreeBuilder

_THINK = re.compile(r"<think>.*?(?:</think>|$)", re.DOTALL)
SHORT = 16  # a reply shorter than this feeds a request only as whole words of it


def main_chain(s: Session) -> list[int]:
    """The conversations the episode runs in, in order (module docstring)."""
    chain = [0]
    for conv in s.convs[1:]:
        cur = s.convs[chain[-1]]
        if cur.calls and conv.first_call > cur.calls[-1] and _continues(conv, cur):
            chain.append(conv.index)
    return chain


def _continues(conv: Conversation, cur: Conversation) -> bool:
    if conv.tool_change_of == cur.index:
        return True
    return bool(conv.tools == cur.tools and _system(conv) == _system(cur))


def _system(conv: Conversation) -> Any:
    return conv.messages[0] if conv.messages and conv.messages[0]["role"] == "system" else None


def reply_text(turn: Turn) -> str:
    """What a turn's reply can hand on: its text without reasoning and without a tool call."""
    content = turn.message.get("content") or ""
    return _THINK.sub("", content).split("<tool_call>", 1)[0].strip()


def _inputs_after(s: Session, chain: list[int]) -> list[tuple[int, str]]:
    """(call, text of a message it sent) for every request of the main chain: what it was fed."""
    out = []
    for c in (s.convs[i] for i in chain):
        for i, call in enumerate(c.calls):
            sent = c.messages if i == 0 else c.turns[i - 1].obs_messages
            out += [(call, m.get("content") or "") for m in sent]
    return out


def _fed(text: str, after: int, inputs: list[tuple[int, str]]) -> bool:
    if not text:
        return False
    short = re.compile(rf"(?<!\w){re.escape(text)}(?!\w)") if len(text) < SHORT else None
    for call, sent in inputs:
        if call > after and (text in sent if short is None else short.search(sent)):
            return True
    return False


def episode_line(s: Session) -> list[int]:
    """The calls of the episode's line, in order (module docstring); sets `s.line` and `s.finish`, the
    limit that ended the chain's last conversation (the episode's reward is then 0), if any."""
    chain = main_chain(s)
    inputs = _inputs_after(s, chain)
    line = set()
    for conv in s.convs:
        if conv.index in chain or any(
            _fed(reply_text(t), call, inputs) for t, call in zip(conv.turns, conv.calls, strict=True)
        ):
            line.update(conv.calls)
    s.line, s.finish = sorted(line), s.convs[chain[-1]].finish
    return s.line


def side_conversations(s: Session) -> list[Conversation]:
    """The conversations outside the line that the session sampled itself (a branch's from its anchor on)."""
    line = set(s.line)
    return [c for c in s.convs if c.calls and not line & set(c.calls) and c.first_call >= s.start]


def _turn(s: Session, call: int) -> Turn:
    conv = s.convs[s.calls[call].conv]
    return conv.turns[conv.calls.index(call)]


def add_line(b: TreeBuilder, s: Session, calls: list[int], parent: int, mask_truncated: bool) -> int:
    """`calls` (of `s.line`) as a chain of turn nodes under `parent` (module docstring); returns the last
    node. Each call's context must extend `parent`'s (its observation set, or set here), else a restart —
    an existing restart child of `parent` with that context is shared (branches from one anchor)."""
    for call in calls:
        ctx, turn = s.calls[call].context, _turn(s, call)
        node = b.node(parent)
        head = b.context_tokens(parent)[
            : -len(node.obs_tokens) or None
        ]  # parent's ids before its observation
        obs = node.obs_tokens.tolist()
        if not obs and ctx[: len(head)] == head:  # extends it: the delta is its observation
            if len(ctx) > len(head):
                b.set_observation(parent, ctx[len(head) :])
        elif not obs or ctx != head + obs:  # another context
            parent = _restart(b, parent, ctx, turn.version)
        cut = turn.finish_reason != "stop" and mask_truncated
        mask = [not cut] * len(turn.ids)
        parent = b.add_turn(parent, turn.ids, turn.logprobs, loss_mask=mask, policy_version=turn.version)
        s.nodes[call] = parent
    return parent


def _restart(b: TreeBuilder, parent: int, ctx: list[int], version: int) -> int:
    for child in b.children(parent):
        if b.is_restart(child) and b.node(child).obs_tokens.tolist() == ctx:
            return child
    return b.add_restart(parent, ctx, version)
