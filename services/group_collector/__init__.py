"""group-collector: staleness window, whole-group drops with re-enqueue, batch assembly into ``{p}:batches``."""
