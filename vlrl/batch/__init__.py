"""The data that crosses between the driver and the ranks, and how it travels.

- `rows`: the typed batches of a step (`PromptBatch`, `RolloutBatch`), their row operations, the
  update's `KeptRows` (row ids and the driver's per-sample or per-token columns) and the streamed
  `FinishedGroups`;
- `image_refs`: images and videos as object-store references, fetched once per step by the rank
  that consumes them.
"""
