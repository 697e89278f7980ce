"""rollout-worker: rolls prompt groups out through the proxy and hands rollout groups on.

Reads ``{p}:prompts`` (consumer group ``rollout``), runs each group's ``n_samples`` trajectories
concurrently (one proxy session each), scores them with the task's verifier and hands the
``rollout_group`` to ``{p}:rollouts`` with the XACK of the prompt in one MULTI/EXEC. A failed
trajectory fails the whole group into the retry path (``retry``), never silently.
"""
