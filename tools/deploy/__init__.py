"""Running a local deployment (``dressage up``: plan, private Redis, supervisor, progress) and generating its ACL.

Services are started as processes (``python -m services SERVICE``) and watched through Redis, never imported.
"""
