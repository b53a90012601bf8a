"""Broker -> each train step's groups: per-rank reads with staleness checks and exact replay.

Collation into a batch, micro-batching and packing (model inputs) are the trainer's
(`rlstream.trainer.batch`, `rlstream.trainer.microbatch`, `rlstream.trainer.packing`).
"""

from rlstream.consumer.reader import StepData, StepReader, consumer_name

__all__ = ["StepData", "StepReader", "consumer_name"]
