"""``python -m services.eval_worker`` is ``dressage eval-worker``."""

from services.eval_worker.main import main

raise SystemExit(main())
