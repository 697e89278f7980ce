"""Turning a run into reports: its metrics log and series, time decomposition, plots, window decisions.

Works on what a run leaves behind (metrics rows, ``decisions.jsonl``, the streams); the statistics are pure.
"""
