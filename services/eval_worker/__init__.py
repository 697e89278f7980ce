"""eval-worker: an rq worker running the evaluation jobs the trainer queues (``shared.evaluation``)."""
