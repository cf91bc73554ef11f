"""The Megatron policy: model construction from a Hugging Face config, per-token log-probs and entropy."""
