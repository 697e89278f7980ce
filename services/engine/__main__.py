"""``python -m services.engine`` is ``dressage engine``."""

from services.engine.main import main

raise SystemExit(main())
