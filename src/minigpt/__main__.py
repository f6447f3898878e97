"""`python -m minigpt COMMAND ...`: see `minigpt.cli`."""

from minigpt.cli import main

raise SystemExit(main())
