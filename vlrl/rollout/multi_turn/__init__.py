"""Multi-turn, tool-using rollouts on the rollout engines (see docs/multi_turn.md).

- `parsing`: hermes `<tool_call>{json}</tool_call>` calls; malformed ones become messages to the model.
- `tools`: schemas from signatures/docstrings, argument checks, return values (no torch: runs in workers).
- `tool_worker`, `tool_pool`: tools isolated in worker processes (the reward worker machinery), with timeouts.
- `shared_tools`: with tensor parallelism, the tools run on the TP leader and its outputs are broadcast.
- `rendering`: tool results and user replies as chat-template text; turns to ids and positions.
- `trajectory`: one trajectory's state and the `RolloutBatch` built from all of them.
- `loop`: the per-turn loop a rollout engine runs (`MultiTurnRollout`).
"""
