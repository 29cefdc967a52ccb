"""Weights into workers: checkpoint shards read straight into parameters, and tensors streamed from a trainer."""
