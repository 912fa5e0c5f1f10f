"""Rollout engines behind one interface: HF generate (embedded) and colocated vLLM."""
