"""Multi-turn rollouts with tensor parallelism: the TP leader runs the tools, the peers get its outputs.

The tools of `mt_tp_tools.py` answer differently in every process (the asking rank's pid, an image
and a text whose size depend on the rank, a hang on ranks other than 0), as a timeout near the
limit, a crash or a random result would. With `SharedTools` the peers of an engine still queue the
same turns, token for token, and finish. (With each peer running its own tools, the behaviour
before it, the peers' queued turns differed after the first tool answer and the engine call never
ended: shown once when `SharedTools` was written, not kept as a test, since it leaves hung ranks to kill.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from mt_helpers import CUES
from mt_tp_job import run_engine, run_shared_tools
from rollout_helpers import free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def taught(taught_tool_model):
    return taught_tool_model


def _load_ranks(out_dir: Path, n: int) -> list[dict]:
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(n)]


def _submissions(out_dir: Path, rank: int) -> list[list]:
    """The batches of turns `rank` queued so far (`mt_tp_job.log_submissions`; complete lines only:
    the rank may be writing the next one)."""
    path = out_dir / f"submitted{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().split("\n")[:-1]] if path.exists() else []


def test_shared_tools_follow_their_own_leader(tmp_path):
    """World of 4, TP groups {0, 1} and {2, 3}: each group's peers get its leader's outputs (calls
    with images and a timeout, interaction replies, polled tickets), only leaders start workers,
    and a leader whose pool fails to start makes its peer raise instead of wait."""
    mp.start_processes(run_shared_tools, args=(4, free_port(), str(tmp_path)), nprocs=4, start_method="spawn")
    ranks = _load_ranks(tmp_path, 4)
    assert [r["leader"] for r in ranks] == [0, 0, 2, 2]
    assert [r["has_pool"] for r in ranks] == [True, False, True, False]
    for rank in ranks:
        leader = ranks[rank["leader"]]
        add, show, hang = rank["call"]
        assert rank["call"] == leader["call"] and rank["polled"] == leader["polled"]
        assert add[0].startswith(f"3 from {leader['pid']}")  # the leader's tool worker answered
        if rank["leader"] == 0:
            assert add == (f"3 from {leader['pid']}", [], False, False)
            assert show == ("here is red", [(56, 56)], False, False) and hang == ("awake", [], False, False)
        else:  # the leader's answers, whatever they are: rank 2's tools give a longer text, a larger
            # image and a hang, which its peer (rank 3) receives as a timeout it did not see itself
            assert add[0].endswith(" ." * 8) and show[1] == [(84, 84)]
            assert hang == ("error: hang timed out after 2s", [], True, True)
        tickets, outputs = rank["polled"]
        assert tickets == [1, 2] and outputs == dict(zip(tickets, rank["call"][:2]))
        assert rank["interact"] == ["sure?", None] and rank["empty"] == ([], [], {})
    assert ranks[0]["start_failure"] == "ValueError: no tools on rank 0"
    assert ranks[1]["start_failure"].startswith(
        "RuntimeError: starting the tool workers failed on the tensor-parallel leader (rank 0)"
    )
    assert ranks[1]["start_failure"].endswith("ValueError: no tools on rank 0")
    assert ranks[2]["start_failure"] == "ValueError: no tools on rank 2"


def test_tp2_peers_queue_the_leaders_tool_turns(taught, tmp_path):
    """One engine over two ranks (TP=2, external_launcher, gloo): greedy, then sampled with
    `overlap_tools` (which calls have finished at a step is the leader's timing). Both peers queue
    the same turns, end with the same trajectories, and those hold the leader's tool outputs."""
    mp.start_processes(
        run_engine, args=(2, free_port(), taught, str(tmp_path)), nprocs=2, start_method="spawn"
    )
    leader, peer = _load_ranks(tmp_path, 2)
    assert leader["has_pool"] and not peer["has_pool"]  # tool workers on the leader only
    # nothing compiled: the embedding's shard mask and the token ranks ran eagerly on CPU
    assert leader["compiled_frames"] == peer["compiled_frames"] == 0
    submitted = _submissions(tmp_path, 0)
    assert len(submitted) >= 4 and submitted == _submissions(tmp_path, 1)  # two calls, each >= 2 batches
    for mode in ("greedy", "overlap"):
        ours, theirs = leader[mode], peer[mode]
        assert ours["trajectories"] == theirs["trajectories"]
        assert ours["image_sizes"] == theirs["image_sizes"]
        for key in ("responses", "response_mask"):
            assert ours[key].equal(theirs[key])
        results = {c["name"]: c for info in ours["trajectories"] for c in info["tool_calls"]}
        assert results["add"]["result"] == f"3 from {leader['pid']}"  # the leader's process answered
        assert results["hang"]["result"] == "awake" and not results["hang"]["timed_out"]
        shown = [sizes[0] for info, sizes in zip(ours["trajectories"], ours["image_sizes"])
                 if info["tool_calls"] and info["tool_calls"][0]["name"] == "show"]  # fmt: skip
        assert shown and set(shown) == {(56, 56)}  # rank 0's image (rank 1's tool draws 84 x 84)
    greedy = leader["greedy"]["trajectories"]
    assert [t["tool_calls"][0]["name"] for t in greedy] == ["show", "add", "hang", None]
    assert len(CUES) == len(greedy)
