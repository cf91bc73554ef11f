"""The training loop's parts, which trainer.py composes: each step's batch from the rollout service
(batch_feed), when the rollout runs beside training (rollout_schedule), the weights onto the servers
(weight_publisher), a step's metrics and watches (step_metrics), and all of them built from the run's config
(build)."""
