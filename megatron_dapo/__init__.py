"""megatron-dapo: DAPO reinforcement learning for reasoning LLMs on Megatron-core."""

__version__ = "0.1.0"
