"""Broker -> training batches: per-rank reads with staleness checks and exact replay,
collation, micro-batching by token budget, packing or padding."""

from rlstream.consumer.collate import BadEntry, SeqBatch, collate
from rlstream.consumer.microbatch import balanced_partition, minibatch_slices, split_by_token_budget, synced_split
from rlstream.consumer.packing import ModelInputs, next_token_logits, packed_inputs, padded_inputs
from rlstream.consumer.reader import StepData, StepReader, consumer_name

__all__ = [
    "BadEntry", "SeqBatch", "collate",
    "balanced_partition", "minibatch_slices", "split_by_token_budget", "synced_split",
    "ModelInputs", "next_token_logits", "packed_inputs", "padded_inputs",
    "StepData", "StepReader", "consumer_name",
]
