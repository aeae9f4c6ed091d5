"""Bring your own agent: an OpenAI-compatible endpoint that records a harness's turns token-in/token-out and
grows rollout trees from it (docs/external-agents.md).

- `openai_format.py`: the wire format (requests checked field by field, tool calls, responses)
- `render.py`: prompt and observation ids from the chat template (deltas only, never a re-render)
- `session.py`: one harness run's sessions, conversations and calls; `turns.py`: one call (routed, rendered
  off the sampling loop, replayed or sampled; retries); `side.py`: which conversation a request goes to, and
  side trees; `line.py`: an episode's line (its compactions, the calls that fed it) as tree nodes
- `replay.py`: prefix forcing (a branch's calls before its anchor answered from the trunk's record)
- `endpoint.py`: the HTTP server (FastAPI/uvicorn in its own thread); `routes.py`: its routes; `keys.py`:
  the token and the per-session keys
- `trees.py`: initialize–expand over the harness (`ExternalTrees`, the tree source of a TreeSampler);
  `episodes.py`: one harness run
- `remote.py`: episodes handed out to an agent in its own process; `discovery.py`: where it finds every
  sampler's endpoint (RUN_DIR/agent_endpoints.json) and the ports of a fixed `env.agent_port`
- `health.py`: the harness's failures in a row (a bound stops the run) and its drop warnings, rate-limited;
  every 4xx counted by reason and logged
"""
