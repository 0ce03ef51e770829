"""The gRPC service: a torch-free asyncio front and a worker process that owns the engine.

Importing this package (or ``server``/``cli``) must not import torch: only the worker process,
started with the multiprocessing *spawn* context, loads the model.
"""
