"""README.md names only things that exist: every `treeopsd <cmd>` is a subcommand of launch/cli.py's parser,
every `section.key` config key is a field of configs/schema.py, every repository path is in the tree, and
every data line of "Quick start on your own model and data" loads through the loader it is named for. The
docs pages that hold what moved out of the README (MOVED_PAGES) get the same command, key and path checks,
their links resolved from docs/.

Names are read from code: inline code spans (in backticks) and fenced code blocks, plus the targets of
relative links. Each assertion lists every offender.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import typing
from pathlib import Path

from pydantic import BaseModel

from configs.schema import Config
from launch.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
TOP_FOLDERS = ("configs", "launch", "learner", "actors", "system", "storage", "benchmarks", "docs", "tests")
# `model.safetensors` is a file name, not the config key model.safetensors
FILE_SUFFIXES = {"py", "yaml", "yml", "json", "jsonl", "md", "safetensors", "log", "arrow", "png", "txt"}
GLOB = re.compile(r"[*?<>{}\[\]]")
# `learner/loss` is a tensorboard tag, not a path: under these, a path has a suffix or ends in /
METRIC_NAMESPACES = ("learner/",)


def readme() -> str:
    return (ROOT / "README.md").read_text()


def code_texts(text: str) -> list[str]:
    """The fenced code blocks and the inline code spans of a markdown text (spans within one paragraph)."""
    fenced = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
    blocks = [m.group(1) for m in fenced.finditer(text)]
    prose = fenced.sub("\n\n", text)
    spans = [m.group(1) for para in prose.split("\n\n") for m in re.finditer(r"`([^`]+)`", para)]
    return blocks + spans


def link_targets(text: str) -> list[str]:
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t and not t.startswith("#")]


# ---- subcommands ------------------------------------------------------------------------------------------


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _positional_choices(parser: argparse.ArgumentParser) -> set[str] | None:
    for action in parser._actions:
        if (
            not action.option_strings
            and action.choices
            and not isinstance(action, argparse._SubParsersAction)
        ):
            return {str(c) for c in action.choices}
    return None


def bad_commands(codes: list[str]) -> list[str]:
    """`treeopsd A [B]` where A is no subcommand, or B no sub-subcommand (or choice) of A."""
    top = _subparsers(build_parser())
    bad = []
    for code in codes:
        for a, b in re.findall(
            r"(?<![\w./-])treeopsd\s+([a-z][\w-]*)(?:[ \t]+([a-z][\w-]*)\b(?![.=/]))?", code
        ):
            if a not in top:
                bad.append(f"treeopsd {a}")
                continue
            nested, choices = _subparsers(top[a]), _positional_choices(top[a])
            allowed = set(nested) or choices
            if b and allowed is not None and b not in allowed:
                bad.append(f"treeopsd {a} {b}")
    return sorted(set(bad))


def test_every_treeopsd_command_is_a_subcommand():
    codes = code_texts(readme())
    found = [c for c in codes if re.search(r"treeopsd\s", c)]
    assert len(found) > 20, "the README names treeopsd commands; the scan found almost none"
    bad = bad_commands(codes)
    assert not bad, f"README.md names treeopsd commands that launch/cli.py does not have: {bad}"


def test_every_subcommand_is_in_the_readme():
    named = {a for code in code_texts(readme()) for a in re.findall(r"treeopsd\s+([a-z][\w-]*)", code)}
    missing = sorted(set(_subparsers(build_parser())) - named)
    assert not missing, f"launch/cli.py subcommands that README.md never names (the command table): {missing}"


# ---- config keys ------------------------------------------------------------------------------------------


def _model_of(annotation: typing.Any) -> type[BaseModel] | None:
    """The pydantic model a field holds (through Optional / Annotated), else None."""
    candidates = [annotation, *typing.get_args(annotation)]
    for c in candidates:
        if isinstance(c, type) and issubclass(c, BaseModel):
            return c
    return None


def _is_mapping(annotation: typing.Any) -> bool:
    return annotation is dict or typing.get_origin(annotation) is dict


def key_exists(key: str) -> bool:
    model: type[BaseModel] | None = Config
    parts = key.split(".")
    for i, part in enumerate(parts):
        assert model is not None
        field = model.model_fields.get(part)
        if field is None:
            return False
        if _is_mapping(field.annotation):  # sampler.engine: vLLM's own names below it
            return True
        model = _model_of(field.annotation)
        if model is None:
            return i == len(parts) - 1
    return True


def config_keys(codes: list[str]) -> list[str]:
    sections = "|".join(Config.model_fields)
    pattern = re.compile(rf"(?<![\w./-])((?:{sections})(?:\.[A-Za-z_]\w*)+)")
    keys = {m.group(1) for code in codes for m in pattern.finditer(code)}
    return sorted(k for k in keys if k.rsplit(".", 1)[1] not in FILE_SUFFIXES)


def test_every_config_key_is_in_the_schema():
    keys = config_keys(code_texts(readme()))
    assert len(keys) > 30, "the README names config keys; the scan found almost none"
    bad = [k for k in keys if not key_exists(k)]
    assert not bad, f"README.md names config keys that configs/schema.py does not have: {bad}"


# ---- repository paths -------------------------------------------------------------------------------------


def repo_paths(texts: list[str]) -> list[str]:
    tops = "|".join(TOP_FOLDERS)
    pattern = re.compile(rf"(?<![\w./<>-])((?:{tops})/[^\s`'\",;()|]*|Makefile\b)")
    out = set()
    for text in texts:
        for m in pattern.finditer(text):
            path = re.split(r"::|:|#", m.group(1), maxsplit=1)[0].rstrip(".")
            tag = path.startswith(METRIC_NAMESPACES) and not (path.endswith("/") or "." in path)
            if not GLOB.search(path) and not tag:
                out.add(path)
    return sorted(out)


def test_every_repository_path_exists():
    text = readme()
    paths = repo_paths(code_texts(text) + link_targets(text))
    assert len(paths) > 30, "the README names repository paths; the scan found almost none"
    bad = [p for p in paths if not (ROOT / p).exists()]
    assert not bad, f"README.md names paths that are not in the repository: {bad}"


# ---- the docs pages that hold what moved out of the README -----------------------------------------------

MOVED_PAGES = ("docs/architecture.md", "docs/results.md", "docs/configuration.md")


def page_link_targets(page: str) -> list[str]:
    """A page's relative link targets as repository paths (resolved from the page's folder)."""
    folder = Path(page).parent
    return [os.path.normpath(folder / t.split("#", 1)[0]) for t in link_targets((ROOT / page).read_text())]


def test_the_moved_pages_name_only_commands_keys_and_paths_that_exist():
    bad, paths, keys = [], set(), set()
    for page in MOVED_PAGES:
        codes = code_texts((ROOT / page).read_text())
        bad += [f"{page}: {c}" for c in bad_commands(codes)]
        page_keys = config_keys(codes)
        bad += [f"{page}: {k}" for k in page_keys if not key_exists(k)]
        page_paths = repo_paths(codes + page_link_targets(page))
        bad += [f"{page}: {p}" for p in page_paths if not (ROOT / p).exists()]
        paths |= set(page_paths)
        keys |= set(page_keys)
    assert len(paths) > 30 and len(keys) > 10, "the moved pages name paths and keys; the scan found few"
    assert not bad, f"docs pages name commands, config keys or paths that do not exist: {bad}"


# ---- the quick start's data lines -------------------------------------------------------------------------

FORMATS = {  # the README's name of a format -> what the loader detects it as
    "FlashRAG / Search-R1": "flashrag",
    "HotpotQA": "hotpotqa",
    "2WikiMultiHopQA": "2wikimultihopqa",
    "MuSiQue": "musique",
    "Bamboogle": "bamboogle",
    "wiki-18": "wiki18",
}


def data_lines() -> list[tuple[str, str, str, str]]:
    """(env.name, key, format name, JSON line) of each `# <env> <key>: <format>` line and the line below."""
    section = readme().split("## Quick start on your own model and data", 1)[1].split("\n## ", 1)[0]
    lines = section.split("```text\n", 1)[1].split("```", 1)[0].splitlines()
    out = []
    for comment, line in zip(lines[::2], lines[1::2], strict=True):
        m = re.fullmatch(r"# (\w+) (env\.data|env\.corpus): ([^,(]+?)(?:,.*| \(.*)?", comment)
        assert m, f"not a '# <env.name> <env.data|env.corpus>: <format>' line: {comment!r}"
        out.append((*m.groups(), line))
    return out


def _load(env: str, key: str, fmt: str, path: Path) -> int:
    """Records the training path reads from `path` (actors/sampler_setup.py: load_split, build_env)."""
    from actors.envs import load_tasks

    if env == "multihop_qa":
        from actors.envs.multihop_qa import detect_format, load_corpus

        assert detect_format(path, json.loads(path.read_text())) == FORMATS[fmt], fmt
        if key == "env.corpus":
            return len(load_corpus(path))
        return sum(1 for t in load_tasks(env, "train", path=path) if t.answers)
    from actors.envs.deep_research import load_documents

    return len(load_documents(path)) if key == "env.corpus" else len(load_tasks(env, "train", path=path))


def test_every_data_line_loads(tmp_path: Path):
    rows = data_lines()
    assert {fmt for env, _, fmt, _ in rows if env == "multihop_qa"} == set(FORMATS)
    assert {(env, key) for env, key, _, _ in rows if env == "deep_research"} == {
        ("deep_research", "env.data"),
        ("deep_research", "env.corpus"),
    }
    bad = []
    for i, (env, key, fmt, line) in enumerate(rows):
        path = tmp_path / f"{i}" / "data.jsonl"
        path.parent.mkdir()
        path.write_text(line + "\n")
        try:
            if _load(env, key, fmt, path) != 1:
                bad.append(f"{fmt}: no record with an answer")
        except (ValueError, KeyError, AssertionError) as e:
            bad.append(f"{fmt}: {e}")
    assert not bad, f"README.md data lines that their loaders refuse: {bad}"
