"""The rollout service (layer 5): training prompts -> engine -> math-verify -> advantages and dynamic sampling ->
the kept batch of a step, and held-out evaluation (rollout_service, evaluation), in a process of its own beside
the driver when it runs over SGLang (rollout_service_process)."""
