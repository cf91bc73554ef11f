"""Fused operators, each beside the plain PyTorch reference that defines it: dapo_loss (the kernel's autograd
wrapper), dapo_loss_reference, kl_penalty, loss_aggregation; loss_settings holds the rules for their settings
without torch. Import each from its module: the run's config reads loss_settings in processes that never run an
op (the reward's judging processes), and importing this package must not load torch there."""
