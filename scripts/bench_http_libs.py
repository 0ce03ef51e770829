#!/usr/bin/env python
"""Server CPU per streamed SSE event of the HTTP libraries the front could use (the choice of
qil_worker/service/http; figures in docs/performance.md).

    python scripts/bench_http_libs.py aiohttp starlette aiohttp starlette

Each name starts a server process with a minimal streaming handler (64 events of one
completions chunk, then [DONE]); 200 requests, 16 concurrent, are driven by httpx from this
process, and the server's user + system CPU over them is divided by the events. Needs aiohttp,
or starlette and uvicorn, and httpx.
"""
import asyncio, json, os, sys, time, socket, resource

EVENTS = 64
CHUNK = json.dumps({"id": "cmpl-x", "object": "text_completion", "created": 1, "model": "m",
                    "choices": [{"index": 0, "text": " tok", "logprobs": None, "finish_reason": None}]})

async def run_aiohttp(port, ready):
    from aiohttp import web
    async def h(request):
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(EVENTS):
            await resp.write(b"data: " + CHUNK.encode() + b"\n\n")
            await asyncio.sleep(0)
        await resp.write(b"data: [DONE]\n\n")
        return resp
    app = web.Application(); app.router.add_post("/v1/completions", h)
    runner = web.AppRunner(app, access_log=None); await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    ready(); await asyncio.Event().wait()

async def run_starlette(port, ready):
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route
    async def h(request):
        await request.body()
        async def gen():
            for _ in range(EVENTS):
                yield b"data: " + CHUNK.encode() + b"\n\n"
                await asyncio.sleep(0)
            yield b"data: [DONE]\n\n"
        return StreamingResponse(gen(), media_type="text/event-stream")
    app = Starlette(routes=[Route("/v1/completions", h, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="off"))
    task = asyncio.ensure_future(server.serve())
    while not server.started: await asyncio.sleep(0.01)
    ready(); await task

def server_main(kind, port):
    def ready(): print("ready", flush=True)
    asyncio.run({"aiohttp": run_aiohttp, "starlette": run_starlette}[kind](port, ready))

async def client(port, n_requests, conc):
    import httpx
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=conc)) as c:
        sem = asyncio.Semaphore(conc)
        async def one():
            async with sem:
                async with c.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x"}) as r:
                    async for _ in r.aiter_raw(): pass
        await asyncio.gather(*(one() for _ in range(n_requests)))

if __name__ == "__main__":
    if sys.argv[1] == "serve": server_main(sys.argv[2], int(sys.argv[3])); sys.exit()
    import subprocess
    for kind in sys.argv[1:]:
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        p = subprocess.Popen([sys.executable, __file__, "serve", kind, str(port)], stdout=subprocess.PIPE, text=True)
        p.stdout.readline()
        asyncio.run(client(port, 20, 4))  # warm
        def cpu():
            with open(f"/proc/{p.pid}/stat") as f: parts = f.read().rsplit(")", 1)[1].split()
            return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")
        c0 = cpu(); t0 = time.perf_counter()
        N = 200
        asyncio.run(client(port, N, 16))
        c1 = cpu(); t1 = time.perf_counter()
        ev = N * (EVENTS + 1)
        print(f"{kind}: {N} streams x {EVENTS+1} events, 16 concurrent: server CPU {(c1-c0)/ev*1e6:.1f} us/event, {(c1-c0)/N*1e3:.2f} ms/request, wall {t1-t0:.2f}s")
        p.kill()
