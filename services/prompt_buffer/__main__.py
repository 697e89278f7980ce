"""``python -m services.prompt_buffer`` is ``dressage prompt-buffer``."""

from services.prompt_buffer.main import main

raise SystemExit(main())
