"""The OpenAI-compatible HTTP API of the front (``serve --http-port``): ``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``, ``/health`` and ``/metrics``, served from the front
process on the same asyncio loop as grpc.aio and handed to the same ``Front`` as the gRPC
servicer (no second process, no hop through the gRPC port).

The library is aiohttp (the ``http`` extra): its server is native asyncio (``AppRunner`` +
``TCPSite`` are started on the running loop like any coroutine, with no signal handlers or loop
of its own to fight grpc.aio over, where ``uvicorn.Server`` installs its own), and it costs the
front the least CPU per streamed event of the candidates measured (starlette on uvicorn costs
about 1.6x as much with uvicorn's pure-Python HTTP parser; FastAPI adds pydantic validation on
top; the figures are in docs/performance.md). The request bodies are validated here by hand:
the engine checks every value range once, and its messages name the parameter.

Modules: ``site`` (the app, its routes, auth and error middleware, start/stop), ``params`` (a
body → the front's submit options), ``completions`` and ``chat`` (the two endpoints),
``choices`` (following the requests of one call), ``sse`` (server-sent events), ``shapes``
(usage, finish reasons, logprobs in the API's shapes), ``token_strings`` (token ids → strings
for logprobs).
"""
