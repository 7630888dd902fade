"""Multi-turn tools under tensor parallelism in a GPU world (`cpu:gloo,cuda:nccl`, as the trainer
builds it): `build_tp_group` makes a gloo subgroup there, object broadcasts stay on the CPU, and the
peer receives the leader's tool outputs (text and image). Two ranks share the one GPU: nothing here
runs an NCCL collective (NCCL refuses two ranks on one device), which is the point: the tools'
broadcast must not need one."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TP_TOOLS = str(Path(__file__).parents[1] / "rollout" / "mt_tp_tools.py")


def _rank(rank: int, port: int, out_dir: str) -> None:
    from torch.distributed.distributed_c10d import _get_object_coll_device

    from vlrl.rollout.multi_turn.shared_tools import SharedTools, build_tp_group
    from vlrl.rollout.multi_turn.tool_pool import ToolPool

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group(
        "cpu:gloo,cuda:nccl", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    tp = build_tp_group(2)
    assert tp is not None
    tools = SharedTools(lambda: ToolPool([f"{TP_TOOLS}:add", f"{TP_TOOLS}:show"], workers=1, timeout=30), tp)
    outputs = tools.call([("add", {"a": 1, "b": 2}, {}), ("show", {"colour": "red"}, {})])
    result = {
        "pid": os.getpid(),
        "device": _get_object_coll_device(tp.group),
        "outputs": [(o.text, [i.size for i in o.images]) for o in outputs],
    }
    tools.close()
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_tool_outputs_cross_a_gloo_subgroup_of_a_gpu_world(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(port, str(tmp_path)), nprocs=2, start_method="spawn")
    leader, peer = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    assert leader["device"] == peer["device"] == "cpu"
    assert (
        leader["outputs"] == peer["outputs"] == [(f"3 from {leader['pid']}", []), ("here is red", [(56, 56)])]
    )
