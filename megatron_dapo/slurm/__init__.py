"""Running DAPO inside a SLURM allocation: the node layout, the SGLang server step, the job launcher."""
