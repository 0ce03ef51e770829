"""The gRPC service: a torch-free asyncio front (``front/``) and a worker process that owns the
engine (``worker/``), with the typed messages between them (``protocol``) and the one mapping
of failures to status codes (``errors``).

Importing this package (or ``front``/``cli``) must not import torch: only the worker process,
started with the multiprocessing *spawn* context, loads the model.
"""
