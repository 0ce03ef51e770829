"""The front process (asyncio, torch-free): the gRPC servicer and the HTTP API, the requests and
tokenizer calls in flight, the streams that follow them, and the supervision of the worker.

Importing any module here must not import torch (``tests/service/test_protos.py`` checks it): only the
worker process, started with the multiprocessing *spawn* context, loads the model.
"""
