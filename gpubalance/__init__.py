"""gpubalance: observability and imbalance diagnosis for multi-GPU NVIDIA RTX servers."""

__version__ = "0.1.0"
