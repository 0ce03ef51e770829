"""The worker process: it owns the engine (model, page pool, scheduler) and the tokenizer, and
answers the front's typed messages (``service.protocol``) with one batch of events per step.
Torch is imported inside ``loop.worker_main`` only, so the front can name it as a spawn target.
"""
