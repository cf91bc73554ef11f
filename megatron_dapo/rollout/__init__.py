"""Rollout: sampling groups of responses from an inference engine (SGLang), and what it needs to run."""
