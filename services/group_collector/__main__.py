"""``python -m services.group_collector`` is ``dressage group-collector``."""

from services.group_collector.main import main

raise SystemExit(main())
