"""fabricnode: a peer-to-peer agent that turns Slurm GPU jobs into one OpenAI-compatible service."""

from fabricnode import native as _native

__version__ = "0.1.0"

# The compiled data plane, when built from the current sources (fabricnode/native.py).
_native.activate(__path__)
