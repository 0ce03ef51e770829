"""Messages between the front (gRPC, asyncio) and the worker process (model, pages, scheduler).

Transport: a duplex ``multiprocessing.Pipe`` of a *spawn* context. Why this and not a socket,
shared memory or a multiprocessing.Queue:

* one pickled message per ``send``: framing and serialisation come for free, and the messages are
  tuples of ints and strs, so pickling is cheap and safe (both ends are our own code);
* ``Connection.poll(timeout)`` lets the worker *block* when idle and drain without blocking when
  busy; ``recv`` in the front's reader thread blocks too — nobody spins;
* the end of the pipe is the liveness signal in both directions: the front sees ``EOFError`` the
  moment the worker dies (SIGKILL included), and the worker sees ``EOFError`` when the front dies,
  and exits on its own;
* a Queue would add a feeder thread per side and hide a dead peer; a raw socket would need our own
  framing for no gain at these message sizes.

Bandwidth is bounded by design: the worker sends ONE message per engine step (all the events of
that step, the answers to the submits it drained, and the page-pool numbers), never one per token.

Front → worker (tuples, first item a tag):

* ``(SUBMIT, request_id, token_ids_or_None, max_new_tokens, stop_token_ids, options)`` where
  ``options`` is a dict of further ``Engine.submit`` keyword arguments (text, messages,
  stop_strings, sampling fields...), only those the client set
* ``(CANCEL, request_id)``
* ``(STATS, ticket)``  — answered in the next batch
* ``(STOP,)``          — finish: cancel everything, close the engine, exit 0

Worker → front:

* ``(READY, info_dict)`` once, after the model is loaded and warmed up
* ``(BATCH, acks, events, stats, tickets, step)`` once per loop iteration, where
  ``acks`` is a list of ``(request_id, error, num_prompt_tokens)`` for each drained SUBMIT
  (``error`` is None when accepted, else ``(kind, field, message)``), ``events`` a list of event
  tuples (below), ``stats`` a tuple ``STATS_FIELDS``, ``tickets`` the STATS tickets this
  batch answers and ``step`` ``(seconds, batch_size)`` of the ``engine.step()`` this iteration
  ran (wall time around the call; batch size: distinct requests with events), or None.
* ``(FATAL, message)`` the worker cannot start (bad model directory...) and exits.

An event tuple is ``(request_id, token_id_or_-1, index, finish_code, error, final, text,
logprob, top_logprobs)`` where ``finish_code`` is 0 while running, else one of ``FINISH_CODES``;
``text`` the new text (None without a tokenizer), ``logprob`` a float or None and
``top_logprobs`` a list of ``(token_id, logprob)`` or None; ``final`` is None for a token event,
else ``(num_prompt_tokens, num_output_tokens, queue_time, ttft, mean_itl, max_itl, e2e,
num_preemptions, num_cached_tokens, stop_reason)`` with -1.0 for a timing that does not exist
and ``stop_reason`` an int (token id), a str (stop string) or None.
"""

from __future__ import annotations

SUBMIT = "s"
CANCEL = "c"
STATS = "i"
STOP = "q"

READY = "R"
BATCH = "B"
FATAL = "F"

# finish codes match qil.v1.FinishReason numbers
FINISH_CODES = {"stop": 1, "length": 2, "cancelled": 3, "error": 4}
FINISH_NAMES = {v: k for k, v in FINISH_CODES.items()}

STATS_FIELDS = (
    "pages_total", "pages_used", "pages_free", "num_running", "num_waiting", "pages_cached",
    "prefix_cache_hit_rate",
)
EMPTY_STATS = (0, 0, 0, 0, 0, 0, 0.0)

# error kinds in submit acks → status codes (mapped in qil_worker.service.errors)
ERR_INVALID = "invalid"
ERR_CAPACITY = "capacity"
ERR_DUPLICATE = "duplicate"
ERR_PRECONDITION = "precondition"  # e.g. text sent to a worker without a tokenizer
ERR_INTERNAL = "internal"
