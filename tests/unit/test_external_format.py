"""The external endpoint's wire format (actors/external/openai_format.py): tool calls parsed from a turn
outside its reasoning, requests refused field by field, conversations compared message by message."""

import json

import pytest

from actors.external.openai_format import (
    ApiError,
    SamplingBounds,
    first_difference,
    normalize_message,
    parse_chat_request,
    split_turn,
)

CALL = '<tool_call>\n{"name": "search", "arguments": {"query": "a b"}}\n</tool_call>'
RUN = SamplingBounds(temperature=1.0, top_p=0.9)


def test_tool_calls_outside_the_reasoning_become_openai_calls():
    content, calls = split_turn(f"<think>maybe {CALL}</think>ok {CALL}")
    assert content == f"<think>maybe {CALL}</think>ok"  # the call inside <think> stays text
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("search", {"query": "a b"})
    ]
    # a generation prompt that opened <think>: everything up to the first </think> is reasoning
    assert split_turn(f"{CALL}</think>done", starts_inside=True) == (f"{CALL}</think>done", [])
    # a block that is no JSON object with a name stays in the content
    assert split_turn("<tool_call>{oops</tool_call>") == ("<tool_call>{oops</tool_call>", [])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "q"}], "temperature": 0.7}, "temperature"),
        ({"messages": [{"role": "user", "content": "q"}], "top_p": 1.0}, "top_p"),
        ({"messages": [{"role": "user", "content": "q"}], "n": 2}, "n"),
        ({"messages": [{"role": "user", "content": "q"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "q"}], "tool_choice": "required"}, "tool_choice"),
        ({"messages": [{"role": "robot", "content": "q"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "q"}], "tools": [{"type": "x"}]}, "tools[0]"),
        ({"messages": [{"role": "user", "content": "q"}], "stream": "yes"}, "stream"),
        ({"messages": [{"role": "user", "content": "q"}], "stream_options": {"chunks": 3}}, "stream_options"),
        (
            {"messages": [{"role": "user", "content": "q"}], "stream_options": {"include_usage": 1}},
            "stream_options",
        ),
    ],
)
def test_a_request_is_refused_naming_its_field(body, param):
    with pytest.raises(ApiError) as err:
        parse_chat_request(body, RUN)
    assert (err.value.status, err.value.param) == (400, param)
    assert err.value.message.startswith(f"{param}: ")


def test_the_run_settings_may_be_restated():
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "q"}]}], "top_p": 0.9}
    req = parse_chat_request({**body, "temperature": 1, "max_completion_tokens": 7}, RUN)
    assert req.messages == [{"role": "user", "content": "q"}] and req.max_tokens == 7


def test_conversations_compare_by_content_and_calls():
    call = {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"query": "x"}'}}
    sent = normalize_message({"role": "assistant", "content": None, "tool_calls": [call]}, "m")
    echo = {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"query":"x"}'}}
    got = normalize_message({"role": "assistant", "content": "", "tool_calls": [echo]}, "m")
    assert first_difference([got], [sent]) is None  # same call, other JSON spacing, None vs ""
    edited = normalize_message({"role": "assistant", "content": "hm", "tool_calls": [echo]}, "m")
    assert (
        first_difference([edited], [sent])
        == "messages[0] (assistant) differs from the recorded one in content"
    )


def _asked(calls, *answers):
    """[user, assistant with `calls` (ids), then a tool message per answered id]."""
    made = [{"id": c, "type": "function", "function": {"name": "search", "arguments": "{}"}} for c in calls]
    tools = [{"role": "tool", "tool_call_id": a, "content": "r"} for a in answers]
    return [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": made},
        *tools,
    ]


def test_a_tool_message_must_answer_a_call_of_the_assistant_before_it():
    assert len(parse_chat_request({"messages": _asked(["c1", "c2"], "c2", "c1")}, RUN).messages) == 4
    for messages, where, said in (
        (_asked(["c1"], "c9"), "messages[2].tool_call_id", "'c9' answers no tool call"),  # no such call
        (_asked(["c1"], "c1", "c1"), "messages[3].tool_call_id", "none left unanswered"),  # answered twice
        (
            [{"role": "tool", "tool_call_id": "c1", "content": "r"}],
            "messages[0].tool_call_id",
            "before it: none",
        ),
        (_asked(["c1"], None), "messages[2].tool_call_id", "missing: say which tool call"),  # no id at all
    ):
        with pytest.raises(ApiError) as err:
            parse_chat_request({"messages": messages}, RUN)
        assert (err.value.status, err.value.param) == (400, where) and said in err.value.message


def test_parallel_tool_calls_false_keeps_the_first_call_only():
    two = f"{CALL}\n{CALL.replace('a b', 'c')}"
    assert len(split_turn(two)[1]) == 2
    content, calls = split_turn(two, max_calls=1)
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"query": "a b"}]
    assert content == CALL.replace("a b", "c")  # the second block stays text, as sampled
    req = {"messages": [{"role": "user", "content": "q"}]}
    assert parse_chat_request(req, RUN).parallel_tool_calls is True
    assert parse_chat_request({**req, "parallel_tool_calls": False}, RUN).parallel_tool_calls is False
