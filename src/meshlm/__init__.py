"""meshlm: train and serve transformer LLMs across a mesh of devices (CPU/gloo or GPU/NCCL)."""

__version__ = "0.1.0"
