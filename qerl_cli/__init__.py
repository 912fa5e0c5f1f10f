"""qerl: quantization-enhanced reinforcement learning (QeRL, arXiv 2510.11696) for LLMs."""

__version__ = "0.1.0"
