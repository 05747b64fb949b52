"""SmolVLA (lerobot): a truncated SmolVLM2 with a flow-matching Llama action expert."""
