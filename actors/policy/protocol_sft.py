"""SFT warm-start of a pretrained model on the synthetic KB's oracle trajectories, written in an agent
protocol (`treeopsd warmstart model.path=M env.protocol=qwen3`; the tiny model's recipe is warmstart.py).

    report = protocol_warmstart("runs/models/smollm2", "runs/models/smollm2-qwen3", "qwen3", steps=40)

A trajectory is built exactly as the agent loop builds its context: `initial_context` of the protocol's
system prompt and the question, then per oracle step the protocol's ids for the call (`action_ids`: the
call in its syntax, ending with the turn's stop) and `observation_tokens` of the real search result after
those ids. The loss covers the call ids only. The model is saved with its tokenizer as an HF folder and
`warmstart.json` (settings, losses) is written last; a finished folder with the same settings is reused.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from actors.envs.synthetic_kb import SyntheticKBEnv
from actors.envs.tool_calls import ToolCall, parse_tool_call
from actors.policy.warmstart import Example, sft_train
from actors.protocols import AgentProtocol, make_protocol
from storage.durable import write_atomic

REPORT = "warmstart.json"


def protocol_examples(protocol: AgentProtocol, env: SyntheticKBEnv, tasks: Sequence[Any]) -> list[Example]:
    """One SFT example per task: the oracle's calls in `protocol`'s syntax (module docstring)."""
    system = protocol.system_prompt(env)
    out = []
    for task in tasks:
        ids = protocol.initial_context(system, env.user_prompt(task))
        mask = [0] * len(ids)
        for action, obs in env.oracle_turns(task):
            call = parse_tool_call(action, env.plain_args)  # the oracle writes plain lines
            if not isinstance(call, ToolCall):
                raise ValueError(f"oracle action {action!r} does not parse: {call.reason}")
            a = protocol.action_ids(call)
            ids, mask = ids + a, mask + [1] * len(a)
            if obs is not None:
                o = protocol.observation_tokens(obs, a)
                ids, mask = ids + o, mask + [0] * len(o)
        out.append(Example(ids, mask, int(task.meta.get("hops", 0))))
    return out


def _settings(model_dir: str, protocol: str, **knobs: Any) -> tuple[dict[str, Any], str]:
    src = Path(model_dir).resolve()
    stamp = max((f.stat().st_mtime_ns for f in src.glob("*.safetensors")), default=0)
    settings = {"model": str(src), "model_mtime": stamp, "protocol": protocol, **knobs}
    return settings, hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def protocol_warmstart(
    model_dir: str,
    out_dir: str | Path,
    protocol: str = "qwen3",
    steps: int = 40,
    n_train: int = 200,
    batch_size: int = 2,
    lr: float = 1e-4,
    seed: int = 0,
    enable_thinking: bool = True,
    progress: bool = True,
    hops: tuple[int, int] = (2, 3),
) -> dict[str, Any]:
    """SFTs the HF model in `model_dir` on `protocol` and saves it to `out_dir` (module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actors.policy.tiny_model import save_pretrained

    out = Path(out_dir)
    knobs: dict[str, Any] = {"steps": steps, "n_train": n_train, "batch_size": batch_size, "lr": lr}
    knobs["seed"] = seed
    if tuple(hops) != (2, 3):  # the default keeps its cache key
        knobs["hops"] = list(hops)
    settings, digest = _settings(model_dir, protocol, enable_thinking=enable_thinking, **knobs)
    if (out / REPORT).is_file() and json.loads((out / REPORT).read_text()).get("settings_hash") == digest:
        return {**json.loads((out / REPORT).read_text()), "cached": True}
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    env = SyntheticKBEnv()
    proto = make_protocol(protocol, tokenizer, env, enable_thinking)
    examples = protocol_examples(proto, env, env.tasks("train", n=n_train, hops=tuple(hops)))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else proto.eot_id
    warmup = max(1, steps // 10)
    losses = sft_train(model, examples, steps, batch_size, lr, warmup, "cosine", seed, pad, progress)
    save_pretrained(out, model, tokenizer)
    report = {
        "model_dir": str(out),
        "protocol": proto.name,
        "loss_first": round(sum(losses[:5]) / len(losses[:5]), 4),
        "loss_last": round(sum(losses[-5:]) / len(losses[-5:]), 4),
        "mean_tokens": round(sum(len(e.ids) for e in examples) / len(examples), 1),
        "seconds": round(time.perf_counter() - t0, 1),
        "settings": settings,
        "settings_hash": digest,
    }
    write_atomic(out / REPORT, json.dumps(report, indent=2).encode())  # last: marks a finished run
    return {**report, "cached": False}
