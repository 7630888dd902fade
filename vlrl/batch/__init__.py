"""The data that crosses between the driver and the ranks, and how it travels.

- `rows`: the typed batches of a step (`PromptBatch`, `RolloutBatch`), their row operations, the
  update's `KeptRows` (row ids and the driver's per-sample or per-token columns) and the streamed
  `FinishedGroups`;
- `held`: rows held where they were generated (`publish`), and how a training rank takes its
  share (`TakePlan`, `take`), by reference, rank to rank;
- `samples`: `StepSamples`, what the driver holds of a step's samples (per-sample values and
  where each row is held);
- `image_refs`: images and videos as object-store references, fetched once per step by the rank
  that consumes them.
"""
