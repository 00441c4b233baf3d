"""A toy serving worker that batches requests and reports its queue to gpubalance over OTLP.

    python docs/examples/otlp_worker.py [--exporter http://127.0.0.1:4318] [--port 8000]

``POST /infer`` (header ``X-Tenant`` optional) waits for a batch of up to 8 requests or 10 ms,
"runs" it for 5 ms + 1 ms per request, and answers with the batch size.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time

from aiohttp import web

from gpubalance.instrument import ServingMetrics

MAX_BATCH, MAX_WAIT_SECONDS = 8, 0.010


async def batcher(queue: asyncio.Queue, metrics: ServingMetrics) -> None:
    while True:
        batch = [await queue.get()]  # (enqueued at, tenant, future)
        deadline = batch[0][0] + MAX_WAIT_SECONDS
        while len(batch) < MAX_BATCH and (left := deadline - time.monotonic()) > 0:
            try:
                batch.append(await asyncio.wait_for(queue.get(), left))
            except TimeoutError:
                break
        started = time.monotonic()
        metrics.set_queue_depth(queue.qsize())
        metrics.batch_started([started - enqueued for enqueued, _, _ in batch])
        await asyncio.sleep(0.005 + 0.001 * len(batch))  # the GPU's work
        for enqueued, tenant, answer in batch:
            answer.set_result(len(batch))
            metrics.request_finished(time.monotonic() - enqueued, tenant)


async def serve(args: argparse.Namespace) -> None:
    queue: asyncio.Queue = asyncio.Queue()
    with ServingMetrics(f"{args.exporter}/v1/metrics", args.worker, gpu_index=args.gpu) as metrics:

        async def infer(request: web.Request) -> web.Response:
            answer = asyncio.get_running_loop().create_future()
            await queue.put((time.monotonic(), request.headers.get("X-Tenant"), answer))
            metrics.set_queue_depth(queue.qsize())
            return web.json_response({"batch_size": await answer})

        app = web.Application()
        app.router.add_post("/infer", infer)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", args.port).start()
        print(f"listening on http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
        stop = asyncio.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(signum, stop.set)
        task = asyncio.create_task(batcher(queue, metrics))
        await stop.wait()
        task.cancel()
        await runner.cleanup()
    # leaving the with block pushed the last values


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--exporter",
        default="http://127.0.0.1:4318",
        help="the exporter's OTLP listener",
    )
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--worker", default="example-worker", help="service.instance.id")
    parser.add_argument("--gpu", type=int, default=0, help="index of the GPU it serves")
    asyncio.run(serve(parser.parse_args()))
