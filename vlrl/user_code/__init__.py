"""User Python files run in child processes: rewards (`vlrl.rewards`) and multi-turn tools and
interactions (`vlrl.rollout.multi_turn`) share it, so neither depends on the other.

- `loading`: a `path/to/file.py:function` imported as a fresh module, with errors that name the file;
- `memory`: the optional address-space cap of a worker and how a worker that ran out is reported;
- `worker_process`: one worker process as its parent sees it (pipe, job in flight, deadline, memory).
"""
