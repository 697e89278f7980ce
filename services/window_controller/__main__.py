"""``python -m services.window_controller`` is ``dressage window-controller``."""

from services.window_controller.main import main

raise SystemExit(main())
