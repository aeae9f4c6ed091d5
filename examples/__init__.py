"""Example harnesses for `env.harness` (docs/external-agents.md)."""
