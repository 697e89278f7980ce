"""The adaptive window: sets ``keep_versions`` while a run goes (docs/staleness.md)."""
