"""README "Train a real model": every `treeopsd` command in its block parses with the real CLI, and every
config file and override it uses loads through configs/schema.py to the values the section promises."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from configs.schema import load_config
from launch.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def commands() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Train a real model", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    out = []
    for line in block.splitlines():
        line = line.split("#", 1)[0].strip()
        if "treeopsd " in line:
            out.append(shlex.split(line.split("treeopsd ", 1)[1]))
    return out


def test_every_command_and_override_of_the_section_is_valid():
    cmds = commands()
    assert [c[0] for c in cmds] == ["retrieve", "eval", "train", "eval"]
    parser = build_parser()
    for argv in cmds:
        args, extra = parser.parse_known_args(argv)
        overrides = [*getattr(args, "overrides", []), *extra]
        assert all(re.fullmatch(r"[a-z_]+(\.[a-z_]+)+=\S+", o) for o in overrides), overrides
        if argv[0] in ("train", "eval"):
            cfg = load_config(ROOT / args.config, overrides)
            assert cfg.env.retriever_url == "http://10.0.0.3:8000" and cfg.env.retriever == "service"
            assert (cfg.env.name, cfg.env.protocol, cfg.env.require_search) == ("multihop_qa", "qwen3", True)
            assert cfg.sampler.backend == "vllm" and cfg.learner.precision == "bfloat16"
            assert cfg.model.path == "/models/Qwen3-4B" and cfg.weights.auth == "curve"
            assert (cfg.resources.learner.pool, cfg.resources.sampler.pool) == ("train", "sample")
    assert cmds[0][:2] == ["retrieve", "serve"] and "--corpus" in cmds[0]
