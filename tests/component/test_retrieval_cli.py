"""`treeopsd retrieve serve` as a user runs it: the ready line, a request, SIGTERM, the index reused on the
next start; bad input (missing corpus, unusable index folder, a taken port, a public address without a
token, dense without an encoder) is one line naming the flag, exit 2, no traceback."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.retrieval_fixtures import post, write_corpus

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TREEOPSD_RETRIEVER_TOKEN"}
    return {**env, "PYTHONPATH": str(ROOT)}


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "launch.cli", "retrieve", "serve", *args]


def _serve_once(corpus: Path, index_dir: Path, *extra: str) -> tuple[str, dict]:
    """Starts the service, waits for its ready line, asks one question, stops it with SIGTERM."""
    proc = subprocess.Popen(
        _cmd("--corpus", str(corpus), "--index-dir", str(index_dir), "--port", "0", *extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=ROOT,
    )
    try:
        line = proc.stdout.readline()
        match = re.search(r"at (http://127\.0\.0\.1:\d+)/retrieve$", line.strip())
        assert match, (line, proc.stderr.read() if proc.poll() is not None else "")
        status, body = post(match.group(1), {"queries": ["mentor"], "topk": 2, "return_scores": True})
        assert status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    return line, body


def test_serve_answers_and_reuses_its_index(tmp_path):
    corpus = write_corpus(tmp_path / "c.jsonl", n=300)
    first, body = _serve_once(corpus, tmp_path / "idx")
    assert "serving 300 passages (bm25, built and saved in" in first
    assert len(body["result"][0]) == 2 and body["result"][0][0]["document"]["id"].startswith("kb-")
    second, again = _serve_once(corpus, tmp_path / "idx")
    assert f"loaded from {tmp_path / 'idx' / 'bm25'}" in second and again == body


def _fails(*args: str, env: dict[str, str] | None = None) -> str:
    out = subprocess.run(
        _cmd(*args), capture_output=True, text=True, env=env or _env(), cwd=ROOT, timeout=120
    )
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith("treeopsd retrieve serve: --")
    return lines[0]


def test_bad_input_is_one_line_naming_the_flag(tmp_path):
    corpus = write_corpus(tmp_path / "c.jsonl", n=20)
    missing = _fails("--corpus", str(tmp_path / "nope.jsonl"), "--port", "0")
    assert missing == f"treeopsd retrieve serve: --corpus {tmp_path / 'nope.jsonl'}: no such file"
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("x")
    assert "--index-dir " + str(a_file) in _fails(
        "--corpus", str(corpus), "--index-dir", str(a_file), "--port", "0"
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"title": "no contents"}\n')
    assert _fails("--corpus", str(bad), "--port", "0").startswith(
        f"treeopsd retrieve serve: --corpus {bad}: line 1"
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = str(taken.getsockname()[1])
        line = _fails("--corpus", str(corpus), "--port", port)
    assert line == f"treeopsd retrieve serve: --port {port}: address already in use on 127.0.0.1"
    public = _fails("--corpus", str(corpus), "--host", "0.0.0.0", "--port", "0")
    assert public.startswith(
        "treeopsd retrieve serve: --host 0.0.0.0: binding 0.0.0.0 (not loopback) needs a token"
    )
    dense = _fails("--corpus", str(corpus), "--index", "dense", "--port", "0")
    assert "--index dense needs --encoder PATH" in dense
    enc = _fails("--corpus", str(corpus), "--index", "dense", "--encoder", str(tmp_path), "--port", "0")
    assert (
        enc.startswith(f"treeopsd retrieve serve: --encoder {tmp_path}: ")
        and "not a sentence-transformers" in enc
    )
    assert "--port 70000" in _fails("--corpus", str(corpus), "--port", "70000")


@pytest.mark.parametrize("where", ["flag", "env"])
def test_a_token_from_the_flag_or_the_environment_is_required(tmp_path, where):
    corpus = write_corpus(tmp_path / "c.jsonl", n=20)
    env = {**_env(), "TREEOPSD_RETRIEVER_TOKEN": "tok"} if where == "env" else _env()
    extra = ("--token", "tok") if where == "flag" else ()
    proc = subprocess.Popen(
        _cmd("--corpus", str(corpus), "--port", "0", *extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        url = re.search(r"at (http://\S+)/retrieve", proc.stdout.readline()).group(1)
        assert post(url, {"queries": ["mentor"]})[0] == 401
        assert post(url, {"queries": ["mentor"]}, token="tok")[0] == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
