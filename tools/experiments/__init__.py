"""The experiment harness (``dressage experiment``): a spec's variants x seeds as bounded runs, their summary,
report and plots.

Each run is a ``dressage up`` deployment of its own; the summary is computed from the runs' outputs only.
"""
