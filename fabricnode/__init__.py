"""fabricnode: a peer-to-peer agent that turns Slurm GPU jobs into one OpenAI-compatible service."""

__version__ = "0.1.0"
