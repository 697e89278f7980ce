"""``python -m services.proxy`` is ``dressage proxy``."""

from services.proxy.main import main

raise SystemExit(main())
