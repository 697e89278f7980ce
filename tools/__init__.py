"""Operations tools: ``dressage up`` (local supervisor), ``status``, ``report``, ``experiment``, ``health``.

Nothing here is imported by a service; these tools read the Redis contract (shared/keys.py,
``{p}:stats``, ``{p}:metrics``, ``{p}:health:*``) and never a service's internals. One package per job:
``deploy``, ``monitor``, ``reports``, ``experiments``, ``dev``.
"""
