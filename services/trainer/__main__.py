"""``python -m services.trainer`` is ``dressage trainer``."""

from services.trainer.main import main

raise SystemExit(main())
