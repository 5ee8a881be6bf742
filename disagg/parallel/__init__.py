"""Tensor parallelism as processes: rank processes, their shared KV memory, the collectives (S3c, S5a)."""
