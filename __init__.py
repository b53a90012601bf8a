"""rlstream: asynchronous RL post-training for LLMs on Redis streams."""

__version__ = "0.1.0"
