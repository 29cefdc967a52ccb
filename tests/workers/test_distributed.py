"""The collectives on real gloo groups: one rank (a group built outside torch.distributed's registry, in this
process), two ranks in two processes (the registry's world group, a group of their own and groups of one), and
three ranks as threads of this process (the gather path). Sums are checked against float64 sums of the parts."""

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from ppo_logprobs.workers.distributed import gather_rows, sum_over

from ..helpers import ranks

TIMEOUT = datetime.timedelta(seconds=60)  # a rank that fails stops waiting instead of hanging the run
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def part(rank, dtype, shape=(53, 37)):
    """Rank `rank`'s part: signed values 2^-3 .. 2^5 whose sums round (and partly cancel); the ranks' parts share
    no seed. A float64 sum of two or three of them is exact, so rounding it once is the correctly rounded sum."""
    g = torch.Generator().manual_seed(100 + rank)
    mantissa = torch.rand(shape, generator=g) + 1
    exponent = torch.randint(-3, 5, shape, generator=g).float()
    sign = torch.randint(0, 2, shape, generator=g) * 2 - 1
    x = (sign * mantissa * 2**exponent).to(dtype)
    # and pairs whose sum rounds to even, or cancels: rank 0 has the big term, rank 1 the small one
    edges = torch.tensor([[2.0**11, 1.0], [1.0, 2.0**-9], [1.0 + 2.0**-7, 2.0**-8], [96.0, -96.0]], dtype=dtype)
    x[0, : len(edges)] = edges[:, min(rank, 1)]
    return x


def rounded_sum(parts, dtype):
    """The float64 sum of the parts, rounded once to dtype."""
    return torch.stack([p.double() for p in parts]).sum(0).to(dtype)


def test_one_rank_outside_the_registry_returns_its_part_in_place():
    """A group of one built from a store (as a worker's own groups are): the sum is x, the very tensor, its bits
    unchanged; gathering gives [1, k, N]. No process group is registered."""
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, TIMEOUT)
    for dtype in DTYPES:
        x = part(0, dtype)
        y = x.clone()
        assert sum_over(y, group) is y and torch.equal(y, x)
        gathered = gather_rows(x, group)
        assert gathered.shape == (1, *x.shape) and torch.equal(gathered[0], x)
    assert not dist.is_initialized()


def test_no_group_is_an_error_not_the_part_returned_as_the_sum():
    """Without a group there is nothing to sum over: refused (the tensor left as it was), never returned as if it
    were the sum."""
    x = part(0, torch.float32)
    y = x.clone()
    for collective in (sum_over, gather_rows):
        with pytest.raises((AttributeError, TypeError, ValueError)):
            collective(y, None)
    assert torch.equal(y, x)


def check_two_ranks(rank, path):
    store = dist.FileStore(path, 2)
    dist.init_process_group("gloo", store=dist.PrefixStore("world", store), rank=rank, world_size=2, timeout=TIMEOUT)
    try:
        own = dist.ProcessGroupGloo(dist.PrefixStore("own", store), rank, 2, TIMEOUT)  # outside the registry
        singles = [dist.new_group([0]), dist.new_group([1])]  # every rank makes every group
        for dtype in DTYPES:
            parts = [part(r, dtype) for r in range(2)]
            want = rounded_sum(parts, dtype)
            assert not torch.equal(want.double(), parts[0].double() + parts[1].double())  # (the sums round)
            for group in (dist.group.WORLD, own):
                x = parts[rank].clone()
                assert sum_over(x, group) is x  # in place
                assert torch.equal(x, want), (dtype, (x.double() - want.double()).abs().max())
                # each element's bits wherever it sits: rows reordered, one row alone, a transposed (strided) view
                order = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(7))
                assert torch.equal(sum_over(parts[rank][order].clone(), group), want[order])
                assert torch.equal(sum_over(parts[rank][5:6].clone(), group), want[5:6])
                strided = parts[rank].clone().t()
                assert torch.equal(sum_over(strided, group), want.t())
                gathered = gather_rows(parts[rank], group)
                assert gathered.shape == (2, *parts[0].shape)
                assert torch.equal(gathered[0], parts[0]) and torch.equal(gathered[1], parts[1])  # rank order
            alone = parts[rank].clone()
            assert torch.equal(sum_over(alone, singles[rank]), parts[rank])  # a group of one: its own part
            assert torch.equal(gather_rows(parts[rank], singles[rank])[0], parts[rank])
        dist.barrier()  # neither rank tears the group down while the other still uses it
    finally:
        dist.destroy_process_group()


def test_two_ranks_sum_to_the_rounded_float64_sum(tmp_path):
    """Two processes: the sum is the float64 sum of both parts rounded once (fp32, bf16, fp16), the same bits on
    both ranks wherever an element sits; gather_rows stacks the parts in rank order; a group of one is identity."""
    ranks(check_two_ranks, (str(tmp_path / "store"),), 2)


def test_three_ranks_add_the_parts_in_rank_order_rounded_once():
    """More than two ranks (threads here, each with a group of its own over one store): every rank gets the parts
    added in rank order in float32 and rounded once to x's dtype, where 16-bit sums rounded at each step differ."""
    store, size = dist.HashStore(), 3
    results, errors = {}, []

    def rank_main(rank):
        try:
            group = dist.ProcessGroupGloo(dist.PrefixStore("three", store), rank, size, TIMEOUT)
            for dtype in DTYPES:
                x = part(rank, dtype) * (rank + 1)
                results[rank, dtype] = sum_over(x, group)
        except Exception as e:  # reported by the test's thread, which asserts
            errors.append((rank, e))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for dtype in DTYPES:
        parts = [part(r, dtype) * (r + 1) for r in range(size)]
        in_order = ((parts[0].float() + parts[1].float()) + parts[2].float()).to(dtype)
        for rank in range(size):
            assert torch.equal(results[rank, dtype], in_order), (rank, dtype)
        if dtype != torch.float32:
            assert torch.equal(in_order, rounded_sum(parts, dtype))  # fp32 holds these 16-bit sums exactly
            step_by_step = (parts[0] + parts[1]) + parts[2]  # rounded to the 16-bit dtype after each addition
            assert not torch.equal(step_by_step, in_order)
        else:
            reordered = (parts[2] + parts[1]) + parts[0]  # (where the order of addition changes fp32 bits)
            assert not torch.equal(reordered, in_order)
