"""Environments, tools and dataset loaders for search / deep-research agents (pure Python, no Ray).

Registry::

    env = make_env("synthetic_kb")                                   # default offline task
    tasks = load_tasks("synthetic_kb", split="eval")                 # 120 held-out questions
    env = make_env("multihop_qa", corpus="wiki-18.jsonl", topk=3)    # a path or a list of Passage
    tasks = load_tasks("multihop_qa", path="hotpot_dev_distractor_v1.json")
    env = make_env("deep_research", corpus="browsecomp_plus_corpus.jsonl")
    tasks = load_tasks("deep_research", path="browsecomp_plus.jsonl", decrypt=True)

Heavy modules (bm25s) are imported on first use so importing this package stays cheap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from actors.envs.base import (
    FINISH_ANSWER,
    FINISH_MALFORMED,
    FINISH_MAX_TURNS,
    EnvFailure,
    Environment,
    StepResult,
    Task,
    Tool,
    ToolEnv,
    ToolError,
)
from actors.envs.records import DatasetFormatError
from actors.envs.rewards import exact_match, f1, normalize_answer
from actors.envs.tool_calls import ParseError, ToolCall, parse_tool_call

ENV_NAMES = ("synthetic_kb", "multihop_qa", "deep_research")

__all__ = [
    "ENV_NAMES",
    "FINISH_ANSWER",
    "FINISH_MALFORMED",
    "FINISH_MAX_TURNS",
    "DatasetFormatError",
    "EnvFailure",
    "Environment",
    "ParseError",
    "StepResult",
    "Task",
    "Tool",
    "ToolCall",
    "ToolEnv",
    "ToolError",
    "exact_match",
    "f1",
    "load_tasks",
    "make_env",
    "normalize_answer",
    "parse_tool_call",
]


def make_env(name: str, **kwargs: Any) -> ToolEnv:
    """Build an environment by name. ``multihop_qa``/``deep_research`` take ``corpus=`` (a file path or a
    list of passages/documents) unless an index is given (``corpus_index=`` / ``index=``)."""
    if name == "synthetic_kb":
        from actors.envs.synthetic_kb import SyntheticKBEnv

        return SyntheticKBEnv(**kwargs)
    if name == "multihop_qa":
        from actors.envs.multihop_qa import MultiHopQAEnv, load_corpus

        corpus = kwargs.pop("corpus", None)
        if corpus is None:
            return MultiHopQAEnv(**kwargs)
        passages = load_corpus(corpus) if isinstance(corpus, (str, Path)) else corpus
        return MultiHopQAEnv.from_passages(passages, **kwargs)
    if name == "deep_research":
        from actors.envs.deep_research import DeepResearchEnv, load_documents

        corpus = kwargs.pop("corpus", None)
        if corpus is None:
            raise ValueError("deep_research needs corpus= (a corpus JSONL path or a list of Document)")
        docs = load_documents(corpus) if isinstance(corpus, (str, Path)) else corpus
        return DeepResearchEnv(docs, **kwargs)
    raise ValueError(f"unknown environment {name!r}; known: {ENV_NAMES}")


def load_tasks(name: str, split: str = "train", path: str | Path | None = None, **kwargs: Any) -> list[Task]:
    """Tasks by env name. ``synthetic_kb`` generates ``split`` ("train", "eval" or "val") from ``config=``
    (KBConfig) and passes other kwargs to train_questions/held_out_questions; the others read ``path``
    (``fmt=``, ``dataset=`` for multihop_qa; ``decrypt=``, ``canary=`` for deep_research)."""
    if name == "synthetic_kb":
        from actors.envs.synthetic_kb import generate_kb, held_out_questions, train_questions

        kb = generate_kb(kwargs.pop("config", None))
        if split not in ("train", "eval", "val"):
            raise ValueError(f"unknown split {split!r}; use 'train', 'eval' or 'val'")
        return train_questions(kb, **kwargs) if split == "train" else held_out_questions(kb, split, **kwargs)
    if name not in ENV_NAMES:
        raise ValueError(f"unknown environment {name!r}; known: {ENV_NAMES}")
    if path is None:
        raise ValueError(f"{name} tasks are read from a local file: pass path=")
    if name == "multihop_qa":
        from actors.envs.multihop_qa import load_dataset

        return load_dataset(path, **kwargs).tasks
    from actors.envs.deep_research import load_queries

    return load_queries(path, **kwargs)
