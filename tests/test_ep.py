"""Expert parallelism on several GPUs: spawns one process per GPU running tests/ep_cases.py.

Skipped unless at least 2 GPUs are visible. ``MEGAMOE_EP_RANKS`` picks the number of ranks (default: 2);
``MEGAMOE_EP_SHAPES`` the shapes (default: small, which includes 1,000 consecutive calls);
``MEGAMOE_EP_FORMATS`` the (weight, activation) format pairs (default: fp8:fp8; e.g. mxfp4:fp8,nvfp4:fp4).
"""
from __future__ import annotations

import os
import socket
import sys
import time

import pytest
import torch

from conftest import CUDA_MARKS

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [*CUDA_MARKS, pytest.mark.skipif(NUM_GPUS < 2, reason="expert parallelism needs 2 GPUs")]

# A hang is a failure, not a stuck CI job: each rank's watchdog (WATCHDOG_S per (format pair, shape) check, then for the
# final barrier) dumps its stacks and exits; this outer deadline, past all of them plus SETUP_S for spawning, imports
# and NCCL setup, only catches what the watchdog cannot.
WATCHDOG_S = 280
SETUP_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, argv: list) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    sys.path.insert(0, os.path.dirname(__file__))
    import ep_cases
    ep_cases.main(argv)


def test_ep_matches_single_gpu():
    import torch.multiprocessing as mp
    world = int(os.environ.get("MEGAMOE_EP_RANKS", "2"))
    if world > NUM_GPUS:
        pytest.skip(f"MEGAMOE_EP_RANKS={world} but only {NUM_GPUS} GPUs")
    shapes, formats = os.environ.get("MEGAMOE_EP_SHAPES", "small"), os.environ.get("MEGAMOE_EP_FORMATS", "fp8:fp8")
    argv = ["--shapes", shapes, "--stress-calls", "1000", "--formats", formats, "--watchdog-s", str(WATCHDOG_S)]
    timeout_s = SETUP_S + (WATCHDOG_S + 20) * (len(shapes.split(",")) * len(formats.split(",")) + 1)
    ctx = mp.start_processes(_worker, args=(world, _free_port(), argv), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.time() + timeout_s
    while not ctx.join(timeout=5):  # raises ProcessRaisedException when a rank fails
        if time.time() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"expert-parallel run did not finish within {timeout_s} s (hang)")
