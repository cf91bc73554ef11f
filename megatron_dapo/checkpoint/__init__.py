"""Checkpoint formats and the one mapping between Hugging Face and Megatron parameter layouts."""
