"""``python -m services.rollout_worker`` is ``dressage rollout-worker``."""

from services.rollout_worker.main import main

raise SystemExit(main())
