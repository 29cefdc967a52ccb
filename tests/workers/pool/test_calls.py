"""calls.py's weight calls, stated once: WeightsHolder and RankGroup answer each with its signature, PoolWorker has
a remote method of that name and signature for each (made from the table, without torch), and the staging calls
are those the owner and a tensor-parallel leader run in the staging thread."""

import inspect
import subprocess
import sys

from ppo_logprobs.workers.pool.calls import WEIGHT_CALLS, in_staging
from ppo_logprobs.workers.pool.pool_worker import PoolWorker
from ppo_logprobs.workers.pool.rank_group import RankGroup
from ppo_logprobs.workers.weights.holder import WeightsHolder


def parameters(method) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(method).parameters.values()]


def test_the_holder_the_rank_group_and_the_actor_answer_every_weight_call_with_its_signature():
    assert set(WEIGHT_CALLS) == {"layout_for", "stage_checkpoint", "stage_stream", "stage_shared", "release_shared",
                                 "abort", "join_group", "leave_group", "open_sender", "send_weights",
                                 "remove_local_copy"}
    for name, call in WEIGHT_CALLS.items():
        for answerer in (WeightsHolder, RankGroup, PoolWorker):
            assert parameters(getattr(answerer, name)) == parameters(call), (answerer.__name__, name)
    assert {name for name in WEIGHT_CALLS if in_staging(name)} == {
        "stage_checkpoint", "stage_stream", "stage_shared", "join_group", "open_sender", "send_weights"}
    assert not in_staging("commit") and not in_staging("score_request")


def test_the_actor_class_imports_no_torch():
    """A process holding only a pool's handles loads PoolWorker's module with them: it stays torch-free."""
    code = "import sys, ppo_logprobs.workers.pool.pool_worker as m; assert m.PoolWorker.stage_stream; " \
           "print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr[-2000:]
