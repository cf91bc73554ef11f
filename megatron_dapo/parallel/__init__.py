"""Process groups and what runs on them (layer 2): torch.distributed and megatron's parallel groups from torchrun
or SLURM (runtime), the CPU redirects and the device-faithful mode (cpu_compat, device_faithful), each rank's
heartbeat (rank_heartbeat), and the batch dealt to the data-parallel ranks and sent to them (rank_shares,
share_scatter)."""
