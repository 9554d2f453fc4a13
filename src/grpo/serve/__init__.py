"""`grpo vllm-serve`: vLLM in its own process behind grpo's authenticated HTTP routes."""
