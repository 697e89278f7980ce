"""`dressage engine`: a CPU inference server that speaks SGLang's HTTP API (the subset RL needs).

So the proxy speaks one protocol everywhere: ``/generate``, ``/abort_request``,
``/pause_generation``, ``/continue_generation``, ``/update_weights_from_disk``, ``/model_info``,
``/get_weight_version``, ``/health``. Requests are decoded together with continuous batching
over a left-padded KV cache (`scheduler.py`, `kv.py`) in one background thread.

Invariants: a weight swap happens only between two forward passes; every output token carries
the version of the weights that produced it (``meta_info.output_token_versions``); an aborted
request returns the tokens it produced so far with ``finish_reason.type == "abort"``.
"""
