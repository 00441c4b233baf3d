"""The supervisor tests' worker command: the lab's live worker for the GPU in
CUDA_VISIBLE_DEVICES, serving nothing (health check 503) until its model-load time is over.

    python serve_worker.py --port P --pool NAME --locks DIR --load-seconds S [--fail-on GPU:POOL]

The worker of that pool on that GPU (`--fail-on 1:be_b`) exits with code 1 when its load is
over, as one whose model does not fit there would: the start a move must undo.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

from aiohttp import web

from gpubalance.lab.live.locks import FileLock, FileSemaphore
from gpubalance.lab.live.worker import Shared, Worker, WorkerConfig

# a 1B model on an RTX 4090: a short prompt takes some 35 ms
MODEL = {"params_billions": 1.0, "bytes_per_param": 2.0, "kv_bytes_per_token": 131072}


def _config(args: argparse.Namespace, gpu: int) -> WorkerConfig:
    return WorkerConfig(
        name=f"gpu{gpu}-{args.pool}",
        index=gpu,
        gpu=gpu,
        gpu_uuid=f"GPU-test-{gpu}",
        card="RTX 4090",
        model_name="test-1b",
        kv_cache_bytes=8 * 1024**3,
        weights_bytes=2 * 1024**3,
        max_batch_size=8,
        max_queue_delay_seconds=0.0,
        cpu_ms=0.0,
        cpu_ms_per_1k=0.0,
        threads=2,
        io_mb_per_request=0.0,
        port=args.port,
        **MODEL,
    )


async def serve(args: argparse.Namespace) -> int:
    gpu = int(os.environ["CUDA_VISIBLE_DEVICES"])
    locks = Path(args.locks)
    shared = Shared(
        cores=FileSemaphore(locks / "cores", 4),
        disk=FileLock(locks / "disk"),
        disk_mb_per_second=SimpleNamespace(value=1000.0),
        engines=[FileLock(locks / f"gpu{g}") for g in range(gpu + 1)],
    )
    # one line per start: the tests count the starts a move made
    print(f"pid {os.getpid()} loads {args.pool} on GPU {gpu}, port {args.port}", flush=True)
    worker = Worker(_config(args, gpu), shared)
    worker.up, worker.down_reason = False, "loading the model"
    runner = web.AppRunner(worker.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", args.port).start()
    batcher = asyncio.create_task(worker.batcher())
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    loaded = asyncio.create_task(asyncio.sleep(args.load_seconds))
    await asyncio.wait([loaded, asyncio.create_task(stop.wait())], return_when="FIRST_COMPLETED")
    code = 0
    if not stop.is_set():
        if args.fail_on == f"{gpu}:{args.pool}":
            print(f"the model of {args.pool} does not fit on GPU {gpu}", file=sys.stderr)
            stop.set()
            code = 1
        else:
            worker.up = True
    await stop.wait()
    batcher.cancel()
    await runner.cleanup()
    return code


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--pool", required=True)
    parser.add_argument("--locks", required=True)
    parser.add_argument("--load-seconds", type=float, default=0.5)
    parser.add_argument("--fail-on", default=None)
    return asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
