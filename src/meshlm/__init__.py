"""meshlm: train and serve transformer LLMs across a mesh of devices (CPU/gloo or GPU/NCCL)."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy, so that `import meshlm` does not import torch and the inference engine.
    if name == "LLM":
        from meshlm.infer.llm import LLM

        return LLM
    if name == "SamplingParams":
        from meshlm.infer.sequence import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'meshlm' has no attribute {name!r}")
