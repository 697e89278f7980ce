"""Code shared by more than one Dressage service: wire schemas, codec, streams, version bus,
staleness logic, config, tasks and model loading. Never imports ``services``."""
