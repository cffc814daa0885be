"""Plain single-device PyTorch models; parallelism is applied to them as transforms (meshlm.parallel)."""

from meshlm.models.moe import MoE
from meshlm.models.transformer import KVCache, Transformer, build_model, init_weights

__all__ = ["KVCache", "MoE", "Transformer", "build_model", "init_weights"]
