"""Policy backends and the tiny local model (HF transformers on CPU; vLLM lives beside them)."""
