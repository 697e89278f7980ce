"""``python -m services <command>`` is the same as ``dressage <command>``."""

from services.cli import main

raise SystemExit(main())
