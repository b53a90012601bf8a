"""Broker -> each train step's groups: per-rank reads with staleness checks and exact replay, and collation.

Micro-batching and packing (model inputs) are the trainer's (`rlstream.trainer.microbatch`,
`rlstream.trainer.packing`).
"""

from rlstream.consumer.collate import BadEntry, SeqBatch, collate
from rlstream.consumer.reader import StepData, StepReader, consumer_name

__all__ = [
    "BadEntry", "SeqBatch", "collate",
    "StepData", "StepReader", "consumer_name",
]
