"""Bring your own agent: an OpenAI-compatible endpoint that records a harness's turns token-in/token-out and
grows rollout trees from it (docs/external-agents.md).

- `openai_format.py`: the wire format (requests checked field by field, tool calls, responses)
- `render.py`: prompt and observation ids from the chat template (deltas only, never a re-render)
- `session.py`: one harness run's requests → turns; the replay and mismatch rules
- `endpoint.py`: the HTTP server (FastAPI/uvicorn in its own thread), auth
- `trees.py`: initialize–expand over the harness (`ExternalTrees`, the tree source of a TreeSampler)
- `remote.py`: episodes handed out to an agent in its own process; `discovery.py`: where it finds every
  sampler's endpoint (RUN_DIR/agent_endpoints.json) and the ports of a fixed `env.agent_port`
- `health.py`: the harness's failures in a row (a bound stops the run) and its drop warnings, rate-limited
"""
