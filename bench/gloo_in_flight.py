"""Whether gloo survives several all-gathers in flight at once, through the functional ``all_gather_into_tensor``
(``torch.ops._c10d_functional``) and through ``torch.distributed.all_gather_single(async_op=True)``: 2 gloo ranks issue
rounds of 64 all-gathers of 1 to 300k elements (fp32 and bf16), each with a small matmul after it, waiting on the oldest
once more than ``--in-flight`` are pending. The reason ``fvx.distributed.sharding`` issues its gathers through the
second (design §3); rerun it on a new torch before going back.

    python bench/gloo_in_flight.py [--rounds 400] [--in-flight 2] [--api functional,async_op]
"""
from __future__ import annotations

import argparse
import datetime
import os
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import free_port  # noqa: E402

OPS_PER_ROUND = 64


def issue(api: str, x: torch.Tensor, world: int):
    """An all-gather of ``x`` in flight; returns what :func:`wait` takes."""
    if api == "functional":
        return torch.ops._c10d_functional.all_gather_into_tensor(x, world, dist.group.WORLD.group_name)
    out = x.new_empty(world * x.numel())
    return out, dist.all_gather_single(out, x, async_op=True)


def wait(api: str, pending) -> torch.Tensor:
    if api == "functional":
        return torch.ops._c10d_functional.wait_tensor(pending)
    pending[1].wait()
    return pending[0]


def rank_main(api: str, rounds: int, in_flight: int) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # (a crashed peer: fail, not hang)
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = torch.randint(1, 300_000, (OPS_PER_ROUND,), generator=torch.Generator().manual_seed(0)).tolist()
    operand = torch.linspace(-1, 1, 200 * 200).reshape(200, 200)  # the compute between issues
    for done in range(rounds):
        pending = []
        for i, n in enumerate(sizes):
            x = torch.full((n,), float(rank + i), dtype=torch.bfloat16 if i % 3 == 0 else torch.float32)
            pending.append((i, issue(api, x, world)))
            operand @ operand
            while len(pending) > in_flight or (i == len(sizes) - 1 and pending):
                j, p = pending.pop(0)
                out = wait(api, p).view(world, -1)
                assert all(bool((out[r] == float(r + j)).all()) for r in range(world)), f"round {done}: wrong values"
        if rank == 0:
            print(f"round {done + 1}", flush=True)
    dist.destroy_process_group()


def launch(api: str, rounds: int, in_flight: int) -> tuple[str, int, float]:
    """(outcome, rounds rank 0 finished, seconds) of 2 ranks of this script."""
    port = free_port()
    start, procs = time.perf_counter(), []
    for rank in range(2):
        env = {**os.environ, "WORLD_SIZE": "2", "RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, __file__, "--rank-of", api, "--rounds", str(rounds),
                                       "--in-flight", str(in_flight)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=60 + rounds)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            logs.append(p.communicate()[0])
    seconds = time.perf_counter() - start
    finished = sum(line.startswith("round ") for line in logs[0].splitlines())
    codes = [p.returncode for p in procs]
    if all(code == 0 for code in codes):
        return "ok", finished, seconds
    signals = [signal.Signals(-c).name for c in codes if c < 0 and c != -signal.SIGKILL]
    if signals:
        return f"crashed ({', '.join(signals)})", finished, seconds
    return ("hung (killed)" if -signal.SIGKILL in codes else f"failed (exit {codes})"), finished, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--in-flight", type=int, default=2, help="all-gathers pending before the oldest is waited on")
    parser.add_argument("--api", default="functional,async_op")
    parser.add_argument("--rank-of", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of:
        return rank_main(args.rank_of, args.rounds, args.in_flight)
    print(f"torch {torch.__version__}, gloo, 2 ranks, {OPS_PER_ROUND} all-gathers a round, "
          f"{args.in_flight + 1} in flight at most")
    print(f"{'api':<12} {'outcome':<22} {'rounds':>8} {'seconds':>8}")
    for api in args.api.split(","):
        outcome, finished, seconds = launch(api, args.rounds, args.in_flight)
        print(f"{api:<12} {outcome:<22} {f'{finished}/{args.rounds}':>8} {seconds:>8.1f}", flush=True)


if __name__ == "__main__":
    main()
