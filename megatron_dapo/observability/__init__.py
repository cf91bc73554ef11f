"""What a run tells its user (layer 1): the metrics it logs (metrics_log: jsonl, tensorboard, wandb), their curves
(metrics_plot) and its log files (run_logging)."""
