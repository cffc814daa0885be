"""Plain PyTorch models: no torch.distributed here; parallelism is applied as transforms."""

from meshlm.models.moe import MoE
from meshlm.models.transformer import KVCache, Transformer, build_model, init_weights

__all__ = ["KVCache", "MoE", "Transformer", "build_model", "init_weights"]
