"""A worked example of a task brought from outside: a shop whose prices only its ``price`` tool knows.

``shop.task:ShopTask`` is the task (loaded by import path), ``shop.tools`` the tool the agent calls,
``data/*.jsonl`` its dataset; ``agent.py`` beside this package is the agent (docs/guides/).
"""
