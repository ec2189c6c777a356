"""Shared by the tests that compare a multi-process setup (DDP, FSDP2, DeepSpeed ZeRO) with one process: gloo ranks
spawned so that they end cleanly (`spawn_gloo_ranks`), and the float32 tolerance of an averaged gradient
(`gradient_tolerance`)."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hfl3.distributed import end_distributed_run

FLOAT32_EPS = torch.finfo(torch.float32).eps  # 2**-23


def spawn_gloo_ranks(function, world_size: int, store_path, *args) -> None:
    """Run `function(rank, *args)` in `world_size` spawned processes joined in one gloo process group (file store at
    `store_path`, 1 thread each, as torchrun sets), and raise the first rank's exception if any.

    A rank that returns ends as every multi-process entry point of hfl3 does, through
    `hfl3.distributed.end_distributed_run` (barrier, process group destroyed, exit 0 without finalizing the
    interpreter: its docstring gives the abort this avoids). A rank that raises exits as `mp.spawn` makes it, after
    writing its traceback, which the parent raises. When the wait itself is interrupted (pytest-timeout), no rank is
    left running.
    """
    ranks = mp.spawn(_run_rank, args=(world_size, str(store_path), function, args), nprocs=world_size, join=False)
    try:
        while not ranks.join():
            pass
    finally:
        for process in ranks.processes:
            if process.is_alive():
                process.kill()


def _run_rank(rank: int, world_size: int, store_path: str, function, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
    function(rank, *args)
    end_distributed_run()


def gradient_tolerance(gradient: torch.Tensor, positions: int, hidden_size: int) -> float:
    """How far two float32 computations of one averaged gradient may differ when they add the same terms in another
    order.

    Each element of a gradient is a float32 sum of n terms: over the token `positions` of the global batch for a
    weight matrix, an embedding, an L3 table or a LoRA factor, and over positions·hidden_size for a scalar that
    multiplies a whole (B, T, hidden) activation (the resid/x0/smear/backout lambdas). One process adds the rows of
    the batch inside one batched kernel; DDP adds each rank's rows, then the all-reduce adds the ranks' sums (FSDP2's
    reduce-scatter and DeepSpeed's buckets in their own orders). A float32 sum computed in any order is within
    u·Σ|partial sums| ≤ (n-1)·u·S of the exact sum (Higham, Accuracy and Stability of Numerical Algorithms,
    2nd ed., §4.2, eq. 4.3; u = eps/2 = 2**-24, S the largest partial sum), so two orders are within (n-1)·eps·S of
    each other. S is taken as the tensor's largest gradient element: the terms of these tensors do not cancel to much
    less than that (measured on tests/test_muon_ddp.py's model, 3 steps, on a 2-core AMD EPYC: differences
    ≤ 6.4·eps·S for the matrices, 30× inside their bound of 192·eps·S; 35·eps·S for the resid/x0 lambdas and
    1,980·eps·S for backout_lambda, whose gradient cancels most, 12× inside their bound of 24,576·eps·S). A tensor
    whose gradient is pure round-off (the backout scalar of a depth-2 L3GPT, which the final RMSNorm cancels) has no
    such bound: the tests use depth 3.

    Args:
        gradient (`torch.Tensor`): the reference gradient of one parameter.
        positions: token positions in the global batch (rows × sequence length).
        hidden_size: the model's hidden size.

    Returns:
        The tolerance n·eps·S, in the gradient's units.
    """
    terms = positions if gradient.ndim >= 2 else positions * hidden_size
    return terms * FLOAT32_EPS * gradient.abs().max().item()
