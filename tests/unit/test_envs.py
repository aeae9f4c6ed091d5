"""The environments: the synthetic KB task (§4.1), step semantics, the QA and deep-research envs, registry."""

from __future__ import annotations

import re
from itertools import pairwise
from pathlib import Path

import fixtures_data as fx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.envs import FINISH_ANSWER, FINISH_MALFORMED, FINISH_MAX_TURNS, Environment, load_tasks, make_env
from actors.envs.base import Task
from actors.envs.deep_research import DeepResearchEnv, load_documents
from actors.envs.multihop_qa import MultiHopQAEnv, load_corpus
from actors.envs.synthetic_kb import (
    RELATIONS,
    SYSTEM_PROMPT,
    KBConfig,
    SyntheticKBEnv,
    eval_questions,
    generate_kb,
    relation_paths,
    tokenizer_texts,
    train_questions,
)


@pytest.fixture(scope="module")
def kb_env() -> SyntheticKBEnv:
    return SyntheticKBEnv()


@pytest.fixture(scope="module")
def eval_tasks(kb_env: SyntheticKBEnv) -> list[Task]:
    return eval_questions(kb_env.kb)


# --- knowledge base ---------------------------------------------------------------------------------------


def test_kb_default_size_and_determinism(kb_env: SyntheticKBEnv) -> None:
    passages = kb_env.kb.passages()
    # 300 persons * 3 + 60 companies * 2 + 80 cities * 1 + 20 countries * 2 = 900 + 120 + 80 + 40
    assert len(passages) == 1140
    again = generate_kb(KBConfig(seed=0))
    assert [p.text for p in again.passages()] == [p.text for p in passages]
    assert eval_questions(again) == eval_questions(kb_env.kb)
    other = generate_kb(KBConfig(seed=1))
    assert [p.text for p in other.passages()] != [p.text for p in passages]


def test_kb_names_and_facts(kb_env: SyntheticKBEnv) -> None:
    ents = kb_env.kb.entities
    assert {k: len(v) for k, v in ents.items()} == {"person": 300, "company": 60, "city": 80, "country": 20}
    assert all(len(p.split()) == 2 for p in ents["person"])
    assert all(re.fullmatch(r"[A-Z][a-z]+ (Corp|Labs|Group|Works)", c) for c in ents["company"])
    words = [w.lower() for names in ents.values() for n in names for w in n.split()]
    name_words = [w for w in words if w not in {"corp", "labs", "group", "works"}]
    assert len(name_words) == len(set(name_words))  # every name word is unique across the KB
    facts = kb_env.kb.facts
    for (subject, relation), obj in facts.items():  # every fact is typed as its relation says
        s_type, o_type = RELATIONS[relation]
        assert subject in ents[s_type] and obj in ents[o_type]
    for country in ents["country"]:  # the capital is one of the country's own cities
        assert facts[(facts[(country, "capital")], "country")] == country
    assert (
        kb_env.kb.passages()[0].text
        == f"The birthplace of {ents['person'][0]} is {facts[(ents['person'][0], 'birthplace')]}."
    )


def test_relation_paths_chain_types() -> None:
    assert ("birthplace", "country") in relation_paths(2)
    assert ("birthplace", "mentor") not in relation_paths(2)  # a city has no mentor
    for path in relation_paths(3):
        assert all(RELATIONS[a][1] == RELATIONS[b][0] for a, b in pairwise(path))


# --- questions and splits ---------------------------------------------------------------------------------


def test_eval_split_shape(eval_tasks: list[Task]) -> None:
    assert len(eval_tasks) == 120
    assert [t.meta["hops"] for t in eval_tasks] == [2] * 40 + [3] * 40 + [4] * 40
    assert len({t.task_id for t in eval_tasks}) == 120
    t = eval_tasks[0]
    path, chain = t.meta["path"], t.meta["chain"]
    # "What is the r_2 of the r_1 of E0?"
    assert t.question == f"What is the {path[1]} of the {path[0]} of {chain[0]}?"
    assert t.answers == (chain[-1],) and t.dataset == "synthetic_kb"
    assert all(len(set(x.meta["chain"])) == len(x.meta["chain"]) for x in eval_tasks)  # no revisits


def test_train_eval_disjoint_and_hop_range(kb_env: SyntheticKBEnv, eval_tasks: list[Task]) -> None:
    def key(t: Task) -> tuple[str, tuple[str, ...]]:
        return t.meta["chain"][0], tuple(t.meta["path"])

    train_all = train_questions(kb_env.kb, hops=(2, 4))
    assert not {key(t) for t in train_all} & {key(t) for t in eval_tasks}
    assert len({key(t) for t in train_all}) == len(train_all)
    default = train_questions(kb_env.kb, n=100)
    assert {t.meta["hops"] for t in default} == {2}  # 2-hop only by default
    mixed = train_questions(kb_env.kb, n=30, hops=(2, 4))
    assert [t.meta["hops"] for t in mixed[:6]] == [2, 3, 4, 2, 3, 4]  # round-robin over hop counts
    assert train_questions(kb_env.kb, n=100) == default  # deterministic
    with pytest.raises(ValueError, match="only"):
        train_questions(kb_env.kb, n=10**6)


def test_every_oracle_trajectory_solves_its_question(kb_env: SyntheticKBEnv, eval_tasks: list[Task]) -> None:
    # All 120 eval questions and every 2-hop training question, replayed through env.step with the real
    # BM25 top-2 search; the oracle reads each next entity from the observation, not from the KB.
    for task in eval_tasks + train_questions(kb_env.kb):
        turns = kb_env.oracle_turns(task)
        assert len(turns) == task.meta["hops"] + 1
        history = []
        for action, expected_obs in turns[:-1]:
            res = kb_env.step(task, history, action)
            assert not res.done and res.observation == expected_obs
            assert len(res.observation.splitlines()) == 2  # top-2, one passage per line
            history.append(res.call)
        final = kb_env.step(task, history, turns[-1][0])
        assert final.done and final.reward == 1.0 and final.info["finish"] == FINISH_ANSWER


def test_oracle_turn_format(kb_env: SyntheticKBEnv, eval_tasks: list[Task]) -> None:
    task = eval_tasks[0]
    chain, path = task.meta["chain"], task.meta["path"]
    turns = kb_env.oracle_turns(task)
    assert turns[0][0] == f"search: {chain[0]} {path[0]}"
    assert f"The {path[0]} of {chain[0]} is {chain[1]}." in turns[0][1].splitlines()
    assert turns[-1] == (f"answer: {chain[-1]}", None)


def test_tokenizer_texts(kb_env: SyntheticKBEnv) -> None:
    texts = tokenizer_texts(kb_env, n_questions=50, n_oracle=5, system_repeats=3)
    passages = [p.text for p in kb_env.kb.passages()]
    assert texts[: len(passages)] == passages
    assert texts.count(SYSTEM_PROMPT) == 3
    assert sum(t.startswith("What is the ") for t in texts) == 50
    assert any(t.startswith("search: ") for t in texts) and any(t.startswith("answer: ") for t in texts)


# --- step semantics (shared ToolEnv) ----------------------------------------------------------------------


def test_kb_env_protocol_and_prompts(kb_env: SyntheticKBEnv, eval_tasks: list[Task]) -> None:
    assert isinstance(kb_env, Environment)
    assert kb_env.system_prompt() == "Use search: <query> or answer: <answer>."
    assert kb_env.user_prompt(eval_tasks[0]) == eval_tasks[0].question
    assert kb_env.max_turns == 6 and kb_env.tool_names == ("search", "answer")
    assert kb_env.snapshot() is None and kb_env.restore(None) is None


def test_step_failures_become_observations(kb_env: SyntheticKBEnv, eval_tasks: list[Task]) -> None:
    task = eval_tasks[0]
    res = kb_env.step(task, [], "foo: bar")
    assert res.observation == "error: unknown tool 'foo'; available: search, answer"
    assert not res.done and res.reward is None and res.info["error"] == "unknown_tool"
    res = kb_env.step(task, [], '<tool_call>{"name": "search", "arguments": {"query": </tool_call>')
    assert res.observation.startswith("error: invalid JSON") and not res.done and res.call is None
    res = kb_env.step(task, [], "search:   ")
    assert res.observation == "error: search needs a non-empty string argument 'query'" and not res.done
    res = kb_env.step(task, [], "search: zzzz qqqq")
    assert res.observation == "no results" and not res.done


def test_step_no_call_ends_with_zero_reward(kb_env: SyntheticKBEnv, eval_tasks: list[Task]) -> None:
    res = kb_env.step(eval_tasks[0], [], "I am not sure what to do.")
    assert res.done and res.reward == 0.0 and res.call is None
    assert res.info["finish"] == FINISH_MALFORMED and res.info["error"] == "no tool call found"
    assert kb_env.max_turns_result().info["finish"] == FINISH_MAX_TURNS


def test_step_json_protocol_and_answer_reward(kb_env: SyntheticKBEnv, eval_tasks: list[Task]) -> None:
    task = eval_tasks[0]
    chain, path = task.meta["chain"], task.meta["path"]
    js = f'<tool_call>{{"name": "search", "arguments": {{"query": "{chain[0]} {path[0]}"}}}}</tool_call>'
    assert (
        kb_env.step(task, [], js).observation
        == kb_env.step(task, [], f"search: {chain[0]} {path[0]}").observation
    )
    right = kb_env.step(task, [], f"<answer>{chain[-1].upper()}</answer>")  # EM normalizes case
    assert right.done and right.reward == 1.0 and right.info["em"] == 1.0 and right.info["f1"] == 1.0
    wrong = kb_env.step(task, [], "answer: Nobody")
    assert wrong.done and wrong.reward == 0.0 and wrong.info["finish"] == FINISH_ANSWER


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=60))
def test_step_never_raises(kb_env: SyntheticKBEnv, text: str) -> None:
    # Property: every model turn maps to a StepResult; a running episode always has an observation.
    task = Task("t", "q?", ("Gold",), "synthetic_kb")
    res = kb_env.step(task, [], text)
    assert res.done or res.observation
    assert (res.reward is not None) == res.done


def test_step_is_deterministic_given_history(kb_env: SyntheticKBEnv, eval_tasks: list[Task]) -> None:
    # Replay from an anchor needs only the calls: a fresh env and a different history give the same step.
    task = eval_tasks[5]
    action = f"search: {task.meta['chain'][0]} {task.meta['path'][0]}"
    first = kb_env.step(task, [], action)
    fresh = SyntheticKBEnv(kb=kb_env.kb).step(task, [first.call] * 3, action)
    assert (fresh.observation, fresh.done, fresh.call) == (first.observation, first.done, first.call)
    assert fresh.info["turn"] == 4


# --- multi-hop QA and deep research envs ------------------------------------------------------------------


def test_multihop_env_search_and_reward(tmp_path: Path) -> None:
    env = MultiHopQAEnv.from_passages(load_corpus(fx.write_wiki18(tmp_path)), topk=3)
    task = Task("q", "Who wrote Hamlet?", ("William Shakespeare",), "flashrag")
    obs = env.step(task, [], "search: Hamlet tragedy").observation
    assert obs.splitlines()[0] == "Doc 1(Title: Hamlet) Hamlet is a tragedy written by William Shakespeare."
    res = env.step(task, [], "answer: Shakespeare")
    # EM 0; F1: pred [shakespeare] vs gold [william, shakespeare]: P 1, R 1/2 -> F1 = 2*0.5/1.5 = 2/3
    assert res.reward == 0.0 and res.info["f1"] == pytest.approx(2 / 3)


def test_deep_research_env_tools(tmp_path: Path) -> None:
    env = DeepResearchEnv(load_documents(fx.write_browsecomp_corpus(tmp_path)), open_chars=100)
    task = load_tasks("deep_research", path=fx.write_browsecomp_queries(tmp_path))[0]
    lines = env.step(task, [], "search: 1996 survey lake").observation.splitlines()
    assert lines[0].startswith("[101] Lake Vostok survey: ") and "1996 survey" in lines[0]
    assert all(len(line) < 300 for line in lines)
    opened = env.step(task, [], "open: 103").observation
    # header "[103] Expedition archive", url line, then 100 of 1,440 body characters and the marker
    assert opened.splitlines()[:2] == ["[103] Expedition archive", "https://example.org/archive"]
    assert opened.endswith("[truncated: 1340 more characters]")
    bad = env.step(task, [], '<tool_call>{"name": "open", "arguments": {"docid": "999"}}</tool_call>')
    assert bad.observation == "error: unknown docid '999'" and not bad.done
    assert env.step(task, [], "answer: lake vostok").reward == 1.0


def test_registry(tmp_path: Path) -> None:
    assert isinstance(make_env("synthetic_kb", max_turns=4), SyntheticKBEnv)
    assert len(load_tasks("synthetic_kb", split="eval")) == 120
    assert len(load_tasks("synthetic_kb", split="train", n=10)) == 10
    qa = make_env("multihop_qa", corpus=fx.write_wiki18(tmp_path), topk=2)
    assert isinstance(qa, MultiHopQAEnv) and qa.topk == 2
    assert [t.task_id for t in load_tasks("multihop_qa", path=fx.write_flashrag(tmp_path))] == [
        "test_0",
        "test_1",
    ]
    assert isinstance(make_env("deep_research", corpus=fx.write_browsecomp_corpus(tmp_path)), DeepResearchEnv)
    with pytest.raises(ValueError, match="unknown environment"):
        make_env("nope")
    with pytest.raises(ValueError, match="path="):
        load_tasks("multihop_qa")
