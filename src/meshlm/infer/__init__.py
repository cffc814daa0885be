"""meshlm.infer: the inference engine (paged KV cache, continuous batching, prefix caching, server).

The torch-free core (sequence, block_manager, scheduler) imports nothing heavy; `LLM`, `Engine` and
friends are loaded on first use so that `import meshlm.infer` stays light.
"""

from meshlm.infer.sequence import SamplingParams

__all__ = ["SamplingParams", "LLM", "Engine", "RequestOutput"]


def __getattr__(name: str):
    if name == "LLM":
        from meshlm.infer.llm import LLM

        return LLM
    if name in ("Engine", "RequestOutput"):
        from meshlm.infer import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'meshlm.infer' has no attribute {name!r}")
